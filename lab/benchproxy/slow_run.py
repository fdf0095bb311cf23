"""Running `globalpool bench-slow-readers` (see lab.benchproxy.slow_readers).

Processes, all with known PIDs and stopped by PID: one embedded Valkey, one fake backend
process per worker (lab.benchproxy.backend, its signed `ready` heartbeats written by
lab.benchproxy.fleet as a worker agent would), and per run a fresh globalpool router
and a load generator process (lab.benchproxy.slow_clients). The router runs alone on
the first core, everything else on the others (with one core nothing is pinned).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab.benchproxy import procs
from lab.benchproxy.routers import (
    Running,
    setup_globalpool,
    wait_ready,
    workers_seen,
)
from lab.benchproxy.slow_observe import (
    HOST,
    Readings,
    delta,
    from_counters,
    from_readings,
    observe,
    probe_health,
)
from lab.benchproxy.slow_options import BENCH_SETTINGS, DUTY, Options
from lab.benchproxy.unavailable import Unavailable
from lab.benchproxy.workloads import PACED_MODEL
from lab.drill.run import with_overrides

READY_TIMEOUT_S = 30.0
LOADGEN_SLACK_S = 60.0  # beyond the run's own bounds, before the load generator is killed


class BenchError(RuntimeError):
    """The bench could not run (a process did not start, a bound was overrun)."""


@dataclass
class Stack:
    """What lives for the whole command: cores, Valkey and the workers' backends."""

    router_cores: set[int] | None
    load_cores: set[int] | None
    pinning: str
    redis_url: str
    backend_urls: list[str]
    backend_pids: list[int]


def split_cores(pin: bool) -> tuple[set[int] | None, set[int] | None, str]:
    """(the router's core, everything else's, a note), or no pinning (asked, or one
    core)."""
    usable = procs.usable_cores()
    if not pin:
        return None, None, "not pinned (--no-pin)"
    if len(usable) < 2:
        return None, None, f"not pinned ({len(usable)} core usable)"
    first, *others = usable
    return {first}, set(others), (f"router on core {first}; backends, load generator, "
                                  f"Valkey and heartbeats on {','.join(map(str, others))}")


async def start_backends(options: Options, cores: set[int] | None,
                         log_dir: Path) -> tuple[list[subprocess.Popen[bytes]], list[int]]:
    """One backend process per worker, each on its own port, all `ready`."""
    ports = [procs.free_port() for _ in range(options.workers)]
    started = []
    for index, port in enumerate(ports):
        started.append(procs.start(
            [sys.executable, "-m", "lab.benchproxy.backend", "--port", str(port),
             "--delay-ms", f"{PACED_MODEL}={options.gap_ms:g}",
             "--token-chars", f"{PACED_MODEL}={options.token_chars}"],
            cores=cores, log_path=log_dir / f"backend-{index}.log", stdout_pipe=True))
    for index, process in enumerate(started):
        assert process.stdout is not None
        try:
            async with asyncio.timeout(30):
                line = await asyncio.to_thread(process.stdout.readline)
        except TimeoutError:
            line = b"(nothing in 30 s)"
        if line.strip() != b"ready":
            for each in started:
                procs.stop(each)
            raise BenchError(f"backend {index} did not start: {line.strip()!r} "
                             f"{procs.log_tail(log_dir / f'backend-{index}.log')}")
    return started, ports


async def _until_all_workers(port: int, workers: int) -> None:
    """Until the router's view holds every worker (GET /health), or BenchError."""
    seen = await workers_seen(HOST, port, workers, READY_TIMEOUT_S)
    if seen < workers:
        raise BenchError(f"the router saw {seen} of {workers} workers in {READY_TIMEOUT_S:g} s")


def plan_of(options: Options, slow_readers: bool, port: int) -> dict[str, Any]:
    """The load generator's spec (lab.benchproxy.slow_clients.Plan) for one run: enough
    clients, each streaming DUTY of the time, that `options.streams` are open at once."""
    streaming_s = max(1, options.tokens - 1) * options.gap_ms / 1000  # first to last token
    period_s = options.tokens * options.gap_ms / 1000 / DUTY
    body = (f'{{"model":"{PACED_MODEL}","messages":[{{"role":"user","content":'
            f'"Tell the slow-reader bench a story."}}],"max_tokens":{options.tokens},'
            f'"stream":true}}')
    return {"host": HOST, "port": port, "body": body,
            "clients": math.ceil(options.streams * period_s / streaming_s),
            "slow_share": options.slow_share, "slow_readers": slow_readers,
            "events": options.tokens + 2, "window_s": options.window_s,
            "warmup_s": period_s if options.warmup_s is None else options.warmup_s,
            "period_s": period_s, "drain_s": period_s + 10.0, "stream_timeout_s": 60.0,
            "slow_bytes_per_s": options.slow_bytes_per_s,
            "slow_rcvbuf_bytes": options.slow_rcvbuf_bytes}


async def _load(plan: dict[str, Any], cores: set[int] | None, log_path: Path) -> Any:
    process = procs.start([sys.executable, "-m", "lab.benchproxy.slow_clients",
                           json.dumps(plan)], cores=cores, log_path=log_path,
                          stdout_pipe=True)
    bound_s = plan["window_s"] + plan["drain_s"] + LOADGEN_SLACK_S
    try:
        async with asyncio.timeout(bound_s):
            out, _ = await asyncio.to_thread(process.communicate)
    except TimeoutError:
        procs.stop(process)
        raise BenchError(f"the load generator overran its bound ({bound_s:g} s)") from None
    if process.returncode != 0:
        raise BenchError(f"load generator exited {process.returncode}: "
                         f"{procs.log_tail(log_path, 600)}")
    return json.loads(out.decode().strip().splitlines()[-1])


async def _start_router(stack: Stack, options: Options, run_dir: Path,
                        port: int) -> tuple[Running, str]:
    """A fresh router on `port` with the bench's settings, ready and seeing every
    worker; returns it and its admin token."""
    setup = await setup_globalpool(stack.redis_url, port, run_dir / "regions.yaml",
                                   stack.backend_urls)
    with_overrides(run_dir / "regions.yaml", [*BENCH_SETTINGS, *options.overrides], run_dir)
    env, tree = setup.env, options.router_tree
    if tree is not None:
        env = {**env, "PYTHONPATH": str(tree)}
    process = procs.start(setup.args, cores=stack.router_cores,
                          log_path=run_dir / "router.log", env=env, cwd=tree)
    running = Running("globalpool", [(HOST, port)], process, run_dir / "router.log",
                      on_stop=[setup.stop_heartbeats])
    try:
        await wait_ready(running)
    except Unavailable as exc:  # (wait_ready stopped it)
        raise BenchError(f"the router did not start: {exc}") from None
    try:
        await _until_all_workers(port, options.workers)
    except BaseException:
        await running.stop()
        raise
    return running, setup.env["GLOBALPOOL_ADMIN_TOKEN"]


async def run_once(stack: Stack, options: Options, round_number: int, slow_readers: bool,
                   say: Callable[[str], None]) -> dict[str, Any]:
    """One run (A: no slow readers, B: with them) through a fresh router."""
    variant = "B" if slow_readers else "A"
    run_dir = options.out / f"round{round_number}-{variant}"
    port = procs.free_port()
    running, token = await _start_router(stack, options, run_dir, port)
    assert running.process is not None
    pid = running.process.pid
    try:
        # Other work on a shared machine: what a busy process gets of the router's core.
        share = await asyncio.to_thread(procs.core_share, stack.router_cores)
        counters_before, _ = await observe(port, token)
        before = Readings.now(pid, stack.backend_pids)
        say(f"[round {round_number}] run {variant}: {options.streams} streams"
            + (f", {options.slow_share:.0%} slow readers" if slow_readers else ""))
        plan = plan_of(options, slow_readers, port)
        probes_s: list[float] = []
        probe = asyncio.create_task(probe_health(port, probes_s))
        try:
            result = await _load(plan, stack.load_cores, run_dir / "loadgen.log")
        finally:
            probe.cancel()
        after = Readings.now(pid, stack.backend_pids)
        counters_after, events = await observe(port, token)
    finally:
        await running.stop()
    row = {"round": round_number, "variant": variant, "slow_readers": slow_readers,
           "clients": plan["clients"], **result, "ejection_events": events}
    row.update(from_counters(delta(counters_before, counters_after)))
    row.update(from_readings(before, after, result, share, probes_s))
    return row


def start_valkey(cores: set[int] | None, log_dir: Path) -> Any:
    from lab.devstack.valkey import EmbeddedValkey

    server = EmbeddedValkey.start(die_with_parent=True, log_path=log_dir / "valkey.log")
    if cores:
        os.sched_setaffinity(server.pid, cores)
    return server


async def bench_slow_readers(options: Options) -> dict[str, Any]:
    """Every round's A and B runs; returns the results document (also written to
    options.out with its table and chart)."""
    import platform

    from lab.benchproxy.slow_report import run_line, write_outputs

    say = options.say
    log_dir = options.out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    router_cores, load_cores, pinning = split_cores(options.pin)
    if load_cores:
        os.sched_setaffinity(0, load_cores)
    started = time.monotonic()
    valkey = start_valkey(load_cores, log_dir)
    runs: list[dict[str, Any]] = []
    try:
        backends, ports = await start_backends(options, load_cores, log_dir)
        try:
            stack = Stack(router_cores, load_cores, pinning, str(valkey.url),
                          [f"http://{HOST}:{port}" for port in ports],
                          [backend.pid for backend in backends])
            say(f"bench-slow-readers: {options.rounds} round(s) of A/B, {options.streams} "
                f"streams, {options.workers} workers; {pinning}")
            for round_number in range(1, options.rounds + 1):
                for slow_readers in (False, True):
                    runs.append(await run_once(stack, options, round_number, slow_readers,
                                               say))
                    say(run_line(runs[-1]))
        finally:
            for backend in backends:
                procs.stop(backend)
    finally:
        valkey.stop()
    document = {
        "meta": {"command": " ".join(["globalpool", *sys.argv[1:]]),
                 "options": {k: (str(v) if isinstance(v, Path) else v)
                             for k, v in vars(options).items() if k != "say"},
                 "bench_settings": list(BENCH_SETTINGS), "pinning": pinning,
                 "python": sys.version.split()[0], "machine": platform.platform(),
                 "cores": os.cpu_count(), "duration_s": round(time.monotonic() - started, 1)},
        "runs": runs,
    }
    write_outputs(document, options.out, say)
    return document
