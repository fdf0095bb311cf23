"""Profile the globalpool router under one workload with py-spy (after the measured runs,
so the sampler never disturbs a measurement).

Writes DIR/profile-<workload>.svg (flame graph) and DIR/profile-<workload>.txt (the
functions with the most own time, then the most total time), from two py-spy recorders
attached with --nonblocking (the router is never paused). py-spy must be installed in
the interpreter's environment (`pip install py-spy`); without it the profile is skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from lab.benchproxy import procs
from lab.benchproxy.routers import Context, Running, start_globalpool
from lab.benchproxy.unavailable import Unavailable
from lab.benchproxy.workloads import Workload

SAMPLE_RATE_HZ = 250
TOP = 25

LoadGen = Callable[[Workload, Running, int, "set[int] | None", Path], Awaitable[dict[str, Any]]]


def py_spy() -> str | None:
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def _function(frame: str) -> str:
    """`handler (router/proxy/stream.py:123)` -> `handler (router/proxy/stream.py)`."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit(':', 1)[0]})" if where else name


def _file(function: str) -> str:
    """`handler (router/proxy/stream.py)` -> `router/proxy/stream.py`."""
    return function.rpartition(" (")[2].rstrip(")") or function


def top_functions(raw: str, limit: int = TOP) -> dict[str, Any]:
    """From py-spy's raw (collapsed stacks) output: samples, and the functions with the most
    own time (leaf of a sample) and total time (anywhere in a sample), with % of samples."""
    own: Counter[str] = Counter()
    own_by_file: Counter[str] = Counter()
    total: Counter[str] = Counter()
    samples = 0
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_function(f) for f in stack.split(";") if f]
        if not frames:
            continue
        samples += count
        own[frames[-1]] += count
        own_by_file[_file(frames[-1])] += count
        for function in set(frames[1:]):  # frames[0] is the thread name
            total[function] += count

    def ranked(counter: Counter[str]) -> list[dict[str, Any]]:
        return [{"function": f, "samples": n, "pct": round(100.0 * n / samples, 1)}
                for f, n in counter.most_common(limit)] if samples else []

    return {"samples": samples, "own": ranked(own), "total": ranked(total),
            "own_by_file": ranked(own_by_file)}


class Profiler:
    def __init__(self, out: Path, cores: set[int] | None, say: Callable[[str], None]) -> None:
        self._out = out
        self._cores = cores
        self._say = say

    async def profile(self, context: Context, workload: Workload, backends_pid: int,
                      loadgen: LoadGen, log_dir: Path) -> dict[str, Any]:
        binary = py_spy()
        if binary is None:
            self._say("profile: SKIPPED - py-spy is not installed (pip install py-spy)")
            return {"skipped": "py-spy is not installed"}
        try:
            running = await start_globalpool(context)
        except Unavailable as exc:
            return {"skipped": str(exc)}
        svg = self._out / f"profile-{workload.name}.svg"
        raw = log_dir / f"profile-{workload.name}.raw"
        recorders: list[subprocess.Popen[bytes]] = []
        try:
            assert running.pid is not None
            for path, form in ((svg, "flamegraph"), (raw, "raw")):
                recorders.append(procs.start(
                    [binary, "record", "--pid", str(running.pid), "--rate", str(SAMPLE_RATE_HZ),
                     "--nonblocking", "--format", form, "-o", str(path)],
                    cores=self._cores, log_path=log_dir / "py-spy.log"))
            await asyncio.sleep(1.0)  # attached before the load starts
            result = await loadgen(workload, running, backends_pid, self._cores, log_dir)
        finally:
            for recorder in recorders:
                if recorder.poll() is None:
                    recorder.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
            for recorder in recorders:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    await asyncio.to_thread(recorder.wait, 60.0)
                await asyncio.to_thread(procs.stop, recorder)
            await running.stop()
        if not raw.exists():
            problem = f"py-spy wrote nothing: {procs.log_tail(log_dir / 'py-spy.log', 300)}"
            self._say(f"profile: FAILED - {problem}")
            return {"skipped": problem}
        summary = top_functions(raw.read_text(errors="replace"))
        text = self._out / f"profile-{workload.name}.txt"
        text.write_text(_render(workload, summary, result))
        self._say(f"profile of globalpool under {workload.name}: {svg.name}, {text.name}")
        return {"svg": svg.name, "text": text.name, "workload": workload.name,
                "requests_per_s_while_profiled": result["requests_per_s"], **summary}


def _render(workload: Workload, summary: dict[str, Any], result: dict[str, Any]) -> str:
    lines = [f"globalpool router under '{workload.title}' ({workload.name}), py-spy "
             f"{SAMPLE_RATE_HZ} Hz, {summary['samples']} samples of a busy thread; "
             f"{result['requests_per_s']:.0f} req/s while profiled", "", "own time:"]
    lines += [f"  {e['pct']:5.1f}%  {e['function']}" for e in summary["own"]]
    lines += ["", "own time by file (run_app = uvloop's C code: epoll, socket I/O):"]
    lines += [f"  {e['pct']:5.1f}%  {e['function']}" for e in summary["own_by_file"]]
    lines += ["", "total time (inclusive):"]
    lines += [f"  {e['pct']:5.1f}%  {e['function']}" for e in summary["total"]]
    return "\n".join(lines) + "\n"
