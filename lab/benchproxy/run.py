"""`globalpool bench-proxy`: every router in front of the same backends, one at a time.

Layout on a machine with two or more cores: the router under test alone on the first
core; the fake backends, the load generator, Valkey, the heartbeat publisher and this
orchestrator on the second (sched_setaffinity in each child's preexec, i.e. what
`taskset -c` does). With one core nothing is pinned.

Per round, routers run in a fixed order (direct, globalpool, aiohttp, vllm-router,
sglang-router, envoy); each gets every workload, each workload in a fresh load-generator
process that reads the router's CPU time itself around the measured phase.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lab.benchproxy import procs
from lab.benchproxy.peers import PEERS, PeerEnv
from lab.benchproxy.profile import Profiler
from lab.benchproxy.routers import OPTIONAL, STARTERS, Context, Running
from lab.benchproxy.unavailable import Unavailable
from lab.benchproxy.workloads import PACED_DELAY_MS, PACED_MODEL, Workload, workloads

BACKEND_PORTS = 4
LOADGEN_SLACK_S = 60.0


@dataclass
class Options:
    out: Path
    quick: bool = False
    only: list[str] | None = None  # router names; None: all (direct is always run)
    rounds: int = 1
    peers_dir: Path | None = None
    profile: list[str] = field(default_factory=list)  # workloads to profile globalpool under
    workloads: list[str] | None = None  # workload names to measure; None: all three
    fleet_workers: int = 10_000  # globalpool-fleet's fleet (routers.start_globalpool_fleet)
    say: Callable[[str], None] = print


class _Valkey:
    """The embedded Valkey, started on first use (only globalpool needs it)."""

    def __init__(self, cores: set[int] | None, log_dir: Path) -> None:
        self._cores = cores
        self._log_dir = log_dir
        self.server: Any = None

    def url(self) -> str:
        if self.server is None:
            from lab.devstack.valkey import EmbeddedValkey

            self.server = EmbeddedValkey.start(die_with_parent=True,
                                               log_path=self._log_dir / "valkey.log")
            if self._cores:
                os.sched_setaffinity(self.server.pid, self._cores)
        return str(self.server.url)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


def _cores() -> tuple[set[int] | None, set[int] | None, str]:
    cores = procs.usable_cores()
    if len(cores) < 2:
        return None, None, f"not pinned (only {len(cores)} core usable)"
    router, rest = {cores[0]}, set(cores[1:])
    return router, rest, (f"router on core {cores[0]}; backends, load generator, Valkey, "
                          f"heartbeats and orchestrator on core(s) "
                          f"{','.join(map(str, sorted(rest)))} (sched_setaffinity)")


async def _start_backends(ports: list[int], cores: set[int] | None,
                          log_dir: Path) -> Any:
    args = [sys.executable, "-m", "lab.benchproxy.backend",
            "--delay-ms", f"{PACED_MODEL}={PACED_DELAY_MS:g}"]
    for port in ports:
        args += ["--port", str(port)]
    process = procs.start(args, cores=cores, log_path=log_dir / "backends.log",
                          stdout_pipe=True)
    assert process.stdout is not None
    async with asyncio.timeout(30):
        line = await asyncio.to_thread(process.stdout.readline)
    if line.strip() != b"ready":
        procs.stop(process)
        tail = procs.log_tail(log_dir / "backends.log")
        raise RuntimeError(f"fake backends did not start: {tail}")
    return process


async def _loadgen(workload: Workload, running: Running, backends_pid: int,
                   cores: set[int] | None, log_dir: Path) -> dict[str, Any]:
    cpu_pids = {"backends": backends_pid}
    if running.pid is not None:
        cpu_pids["router"] = running.pid
    spec = {"workload": workload.to_json(), "targets": running.targets, "cpu_pids": cpu_pids}
    args = [sys.executable, "-m", "lab.benchproxy.loadgen", json.dumps(spec)]
    process = procs.start(args, cores=cores, log_path=log_dir / "loadgen.log",
                          stdout_pipe=True)
    try:
        async with asyncio.timeout(workload.time_limit_s * 2 + LOADGEN_SLACK_S):
            out, _ = await asyncio.to_thread(process.communicate)
    except TimeoutError:
        procs.stop(process)
        raise RuntimeError("the load generator overran its bound") from None
    if process.returncode != 0:
        raise RuntimeError(f"load generator exited {process.returncode}: "
                           f"{procs.log_tail(log_dir / 'loadgen.log', 600)}")
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return result


async def _backend_connections(context: Context) -> int | None:
    """Connections the backends accepted so far (not counting this query's own)."""
    import aiohttp

    host, port = context.host, context.backend_ports[0]
    try:
        async with (aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session,
                    session.get(f"http://{host}:{port}/bench/connections") as answer):
            return int((await answer.json())["accepted"]) - 1
    except (aiohttp.ClientError, TimeoutError, KeyError, ValueError):
        return None


def _row(round_number: int, name: str, workload: Workload, running: Running | None,
         result: dict[str, Any] | None, problem: str | None) -> dict[str, Any]:
    row: dict[str, Any] = {"round": round_number, "router": name, "workload": workload.name,
                           "version": running.version if running else None}
    if result is None:
        row.update(status="skipped", reason=problem)
        return row
    cpu_s = result["cpu_s"]
    router_cpu = cpu_s.get("router")
    completed = result["completed"]
    wall = result["wall_s"]
    row.update(
        status="ok" if completed and not result["errors"] else "errors" if completed else "failed",
        reason=problem, completed=completed, errors=result["errors"],
        error_samples=result["error_samples"] or result["warmup_error_samples"],
        requests_per_s=result["requests_per_s"], wall_s=wall,
        ttft_ms=result["ttft_ms"], e2e_ms=result["e2e_ms"],
        router_cpu_s=router_cpu,
        cpu_us_per_request=(router_cpu / completed * 1e6
                            if router_cpu is not None and completed else None),
        router_core_pct=router_cpu / wall * 100 if router_cpu is not None and wall else None,
        backends_core_pct=cpu_s["backends"] / wall * 100 if cpu_s.get("backends") else None,
        loadgen_core_pct=cpu_s["loadgen"] / wall * 100 if cpu_s.get("loadgen") else None,
        hit_time_limit=result["hit_time_limit"],
        upstream_connections_opened=result.get("upstream_connections_opened"),
    )
    return row


async def bench_proxy(options: Options) -> dict[str, Any]:
    """Run everything; returns the results document (also written to options.out)."""
    say = options.say
    out = options.out
    log_dir = out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    router_cores, load_cores, pinning = _cores()
    if load_cores:
        os.sched_setaffinity(0, load_cores)
    names = ["direct", *(options.only or [n for n in STARTERS
                                          if n != "direct" and n not in OPTIONAL])]
    unknown = [n for n in names if n not in STARTERS]
    if unknown:
        raise ValueError(f"unknown router(s) {', '.join(unknown)} (known: "
                         f"{', '.join(n for n in STARTERS if n != 'direct')})")
    every = workloads(options.quick)
    known = [w.name for w in every]
    wrong = [n for n in [*(options.workloads or []), *options.profile] if n not in known]
    if wrong:
        raise ValueError(f"unknown workload(s) {', '.join(wrong)} (known: {', '.join(known)})")
    plan = [w for w in every if options.workloads is None or w.name in options.workloads]
    peers = PeerEnv(options.peers_dir or _default_peers_dir())
    await asyncio.to_thread(peers.ensure, [n for n in names if n in PEERS], say)
    valkey = _Valkey(load_cores, log_dir)
    ports = [procs.free_port() for _ in range(BACKEND_PORTS)]
    backends = await _start_backends(ports, load_cores, log_dir)
    context = Context(backend_ports=ports, out_dir=out, router_cores=router_cores,
                      fleet_workers=options.fleet_workers,
                      peers=peers, redis_url=valkey.url)
    rows: list[dict[str, Any]] = []
    profiles: dict[str, Any] = {}
    started = time.monotonic()
    share_before = await asyncio.to_thread(procs.core_share, router_cores)
    say(f"bench-proxy: {len(names)} routers x {len(plan)} workloads x {options.rounds} "
        f"round(s); {pinning}; a busy process on the router core gets "
        f"{_pct(share_before)} of it now")
    try:
        for round_number in range(1, options.rounds + 1):
            for name in names:
                await _one_router(name, round_number, plan, context, backends.pid,
                                  load_cores, log_dir, rows, say)
        for workload_name in options.profile:
            workload = next(w for w in every if w.name == workload_name)
            profiles[workload_name] = await Profiler(out, load_cores, say).profile(
                context, workload, backends.pid, _loadgen, log_dir)
    finally:
        procs.stop(backends)
        valkey.stop()
    share_after = await asyncio.to_thread(procs.core_share, router_cores)
    document = {
        "meta": {
            "command": " ".join(["globalpool", *sys.argv[1:]]) if sys.argv else "",
            "quick": options.quick, "rounds": options.rounds, "pinning": pinning,
            "backends": f"{BACKEND_PORTS} ports of one raw-asyncio process "
                        "(lab.benchproxy.backend)",
            "workloads": [w.to_json() for w in plan],
            "python": sys.version.split()[0], "machine": platform.platform(),
            "cores": os.cpu_count(), "duration_s": round(time.monotonic() - started, 1),
            "unavailable": {n: p for n, p in peers.problems.items() if n in names},
            "router_core_share": {"before": share_before, "after": share_after},
        },
        "results": rows,
        "profiles": profiles,
    }
    from lab.benchproxy.report import write_outputs

    write_outputs(document, out, say)
    return document


def _pct(share: float | None) -> str:
    return "?" if share is None else f"{share * 100:.0f}%"


def _default_peers_dir() -> Path:
    from lab.benchproxy.peers import default_peers_dir

    return default_peers_dir()


async def _one_router(name: str, round_number: int, plan: list[Workload], context: Context,
                      backends_pid: int, load_cores: set[int] | None, log_dir: Path,
                      rows: list[dict[str, Any]], say: Callable[[str], None]) -> None:
    say(f"[round {round_number}] {name}: starting")
    try:
        running = await STARTERS[name](context)
    except Unavailable as exc:
        say(f"[round {round_number}] {name}: SKIPPED - {exc}")
        rows.extend(_row(round_number, name, w, None, None, str(exc)) for w in plan)
        return
    try:
        for workload in plan:
            connections_before = await _backend_connections(context)
            try:
                result = await _loadgen(workload, running, backends_pid, load_cores, log_dir)
                connections_after = await _backend_connections(context)
                if connections_before is not None and connections_after is not None:
                    result["upstream_connections_opened"] = connections_after - connections_before
            except RuntimeError as exc:
                say(f"[round {round_number}] {name} / {workload.name}: FAILED - {exc}")
                rows.append(_row(round_number, name, workload, running, None, str(exc)))
                continue
            row = _row(round_number, name, workload, running, result, None)
            rows.append(row)
            cpu = row["cpu_us_per_request"]
            say(f"[round {round_number}] {name:>13} / {workload.name:<6}: "
                f"{row['requests_per_s']:8.0f} req/s, TTFT p99 {row['ttft_ms']['p99']:7.2f} ms, "
                f"CPU {'-' if cpu is None else f'{cpu:.0f} us'}/req, errors {row['errors']}")
    finally:
        await running.stop()
