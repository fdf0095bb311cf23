"""`globalpool bench-instructions`: the router's instructions per proxied request, counted.

CPU time on a shared machine moves by 10-20% between runs, more than most changes to the
hot path are worth; the instructions the router's process executes per request do not
(repeat runs agree within about 0.5%). This runs globalpool as `bench-proxy` does (the
same fake backends, config, signed heartbeats and load generator) but under valgrind's
callgrind, with counting switched on only around the measured phase, and prints
instructions per request for each workload, for this tree and any other source trees
given (`--tree`, e.g. a `git worktree` of the commit before a change), side by side, and
with `--vllm-router` for vllm-router in front of the same backends.

What it does not see: system calls (the kernel's share, about a quarter of the router's
CPU here) and cache misses. Streams are slowed ~50x under valgrind, so their chunks
batch more than they would: compare their figures between trees, not with CPU times.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from lab.benchproxy import procs
from lab.benchproxy.peers import PeerEnv
from lab.benchproxy.routers import (
    Running,
    setup_globalpool,
    vllm_router_args,
    wait_ready,
)
from lab.benchproxy.run import (
    BACKEND_PORTS,
    _cores,
    _default_peers_dir,
    _loadgen,
    _start_backends,
    _Valkey,
)
from lab.benchproxy.unavailable import Unavailable
from lab.benchproxy.workloads import workloads

WARMUP_REQUESTS = 200
READY_UNDER_VALGRIND_S = 600.0  # importing the router runs ~50x slower too
TIME_LIMIT_S = 600.0


@dataclass
class Options:
    out: Path | None
    trees: list[Path]  # source trees (checkouts) whose router is measured, in order
    workloads: list[str]
    requests: int = 1000
    vllm_router: bool = False  # also vllm-router, after the trees (installed as bench-proxy does)
    peers_dir: Path | None = None


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise Unavailable(f"`{name}` is not installed (Debian: apt-get install valgrind)")
    return path


def _dumps(work: Path, name: str, pid: int) -> list[Path]:
    """callgrind's dump files of the router `name` (process `pid`)."""
    return sorted(work.glob(f"callgrind.{name}.{pid}*"))


def _totals(paths: list[Path]) -> int:
    """The largest event total in callgrind's dumps (the one taken while counting)."""
    best = 0
    for path in paths:
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith(("summary:", "totals:")):
                best = max(best, int(line.split()[1]))
    return best


async def _measure_tree(tree: Path, number: int, options: Options, work: Path,
                        redis_url: str, backend_ports: list[int], backends_pid: int,
                        router_cores: set[int] | None, load_cores: set[int] | None,
                        say: Any) -> list[dict[str, Any]]:
    """globalpool from the source tree `tree`, set up as bench-proxy sets it up."""
    port = procs.free_port()
    setup = await setup_globalpool(redis_url, port, work / f"tree-{number}-regions.yaml",
                                   [f"http://127.0.0.1:{p}" for p in backend_ports])
    try:
        return await _measure(str(tree), f"tree-{number}", setup.args, port,
                              {**setup.env, "PYTHONPATH": str(tree)}, tree, options, work,
                              backends_pid, router_cores, load_cores, say)
    finally:
        await setup.stop_heartbeats()


async def _measure_vllm_router(peers: PeerEnv, options: Options, work: Path,
                               backend_ports: list[int], backends_pid: int,
                               router_cores: set[int] | None, load_cores: set[int] | None,
                               say: Any) -> list[dict[str, Any]]:
    """vllm-router as bench-proxy runs it (round robin over the same backends)."""
    port = procs.free_port()
    argv = vllm_router_args(peers.binary("vllm-router"), "127.0.0.1", port,
                            [f"http://127.0.0.1:{p}" for p in backend_ports])
    label = f"vllm-router {peers.version('vllm-router')}"
    return await _measure(label, "vllm-router", argv, port, dict(os.environ), work, options,
                          work, backends_pid, router_cores, load_cores, say)


async def _measure(label: str, name: str, argv: list[str], port: int, env: dict[str, str],
                   cwd: Path, options: Options, work: Path, backends_pid: int,
                   router_cores: set[int] | None, load_cores: set[int] | None,
                   say: Any) -> list[dict[str, Any]]:
    """`argv` (a router listening on `port`) under callgrind: each workload after a
    warm-up, counting only its measured requests."""
    valgrind, control = _tool("valgrind"), _tool("callgrind_control")
    out_pattern = work / f"callgrind.{name}.%p"
    process = procs.start(
        [valgrind, "--tool=callgrind", "--instr-atstart=no",
         f"--callgrind-out-file={out_pattern}", *argv],
        cores=router_cores, log_path=work / f"{name}-router.log", env=env, cwd=cwd)
    running = Running(name, [("127.0.0.1", port)], process, work / f"{name}-router.log")
    rows: list[dict[str, Any]] = []
    try:
        await wait_ready(running, timeout_s=READY_UNDER_VALGRIND_S)
        for workload_name in options.workloads:
            workload = next(w for w in workloads(False) if w.name == workload_name)
            warm = replace(workload, requests=WARMUP_REQUESTS, warmup_requests=0,
                           time_limit_s=TIME_LIMIT_S)
            measured = replace(workload, requests=options.requests, warmup_requests=0,
                               time_limit_s=TIME_LIMIT_S)
            await _loadgen(warm, running, backends_pid, load_cores, work)
            for old in _dumps(work, name, process.pid):
                old.unlink()
            await asyncio.to_thread(subprocess.run, [control, "-z", str(process.pid)],
                                    capture_output=True, check=False)
            await asyncio.to_thread(subprocess.run, [control, "-i", "on", str(process.pid)],
                                    capture_output=True, check=True)
            result = await _loadgen(measured, running, backends_pid, load_cores, work)
            await asyncio.to_thread(subprocess.run, [control, "-i", "off", str(process.pid)],
                                    capture_output=True, check=True)
            await asyncio.to_thread(subprocess.run, [control, "-d", str(process.pid)],
                                    capture_output=True, check=True)
            total = _totals(_dumps(work, name, process.pid))
            completed = int(result["completed"])
            row = {"router": label, "workload": workload_name, "requests": completed,
                   "errors": int(result["errors"]),
                   "instructions_per_request": round(total / completed) if completed else None}
            rows.append(row)
            say(f"{label}: {workload_name:<6} {row['instructions_per_request'] or 0:>10,} "
                f"instructions per request ({completed} requests, {row['errors']} errors)")
    finally:
        await asyncio.to_thread(procs.stop, process, 60.0)
    return rows


async def bench_instructions(options: Options, say: Any = print) -> dict[str, Any]:
    _tool("valgrind")
    work = options.out or Path(os.environ.get("TMPDIR", "/tmp")) / "globalpool-instructions"
    work.mkdir(parents=True, exist_ok=True)
    router_cores, load_cores, pinning = _cores()
    if load_cores:
        os.sched_setaffinity(0, load_cores)
    valkey = _Valkey(load_cores, work)
    ports = [procs.free_port() for _ in range(BACKEND_PORTS)]
    backends = await _start_backends(ports, load_cores, work)
    rows: list[dict[str, Any]] = []
    try:
        for number, tree in enumerate(options.trees):
            rows += await _measure_tree(tree, number, options, work, valkey.url(), ports,
                                        backends.pid, router_cores, load_cores, say)
        if options.vllm_router:
            peers = PeerEnv(options.peers_dir or _default_peers_dir())
            await asyncio.to_thread(peers.ensure, ["vllm-router"], say)
            rows += await _measure_vllm_router(peers, options, work, ports, backends.pid,
                                               router_cores, load_cores, say)
    finally:
        procs.stop(backends)
        valkey.stop()
    document = {"meta": {"requests": options.requests, "pinning": pinning,
                         "python": sys.version.split()[0]},
                "results": rows}
    say(render(rows))
    if options.out is not None:
        (options.out / "instructions.json").write_text(json.dumps(document, indent=2) + "\n")
    return document


def render(rows: list[dict[str, Any]]) -> str:
    """A table: one line per router and workload, with the ratio to the first one's."""
    first: dict[str, int] = {}
    lines = ["| router | workload | instructions per request | x first |",
             "|---|---|---|---|"]
    for row in rows:
        count = row["instructions_per_request"]
        base = first.setdefault(row["workload"], count)
        ratio = f"{count / base:.3f}x" if count and base else "-"
        lines.append(f"| {row['router']} | {row['workload']} | "
                     f"{count if count is None else f'{count:,}'} | {ratio} |")
    return "\n".join(lines)
