"""One policy's run on the test bed, and what it measures besides the clients' view.

    routers restarted with the policy -> engines idle (and the machine calm, bounded) ->
    the scenario's CPU hogs started, if it has any (lab.bench.noise) ->
    replay the trace open loop while polling the engines' /metrics and the heartbeats ->
    hogs stopped ->
    summary: latencies, SLO, goodput, shares, prefix hits, oscillation, what the routers
    saw, load generator lag, CPU used by the test bed and CPU pressure on the machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab.bench import stats
from lab.bench.heartbeats import HeartbeatWatch
from lab.bench.noise import HostNoise
from lab.bench.observe import EngineEndpoint, EngineSample, EngineWatch, prefix_hit_rate
from lab.bench.progress import ProgressBar
from lab.bench.replay import Outcome, Replayer
from lab.bench.scenario import Scenario
from lab.bench.testbed import KEY_PREFIX, Testbed
from lab.bench.trace import PromptBuilder, Trace
from lab.bench.workload import sync_moments

Say = Callable[[str], None]

def cpu_pressure() -> tuple[float, float] | None:
    """Linux PSI for the CPU: (share of the last 10 s in which some runnable task waited,
    microseconds of such waiting since boot); None where /proc/pressure is missing."""
    try:
        line = Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    fields = dict(part.split("=", 1) for part in line.split()[1:])
    return float(fields["avg10"]) / 100.0, float(fields["total"])


MAX_WAIT_S = 120.0  # the longest the benchmark waits for idle engines or a calm machine


async def wait_for_quiet(say: Say, *, limit: float = 0.25, timeout_s: float = MAX_WAIT_S
                         ) -> None:
    """Wait (bounded) until other work on the machine leaves the CPUs mostly free."""
    deadline = time.monotonic() + timeout_s
    pressure = cpu_pressure()
    if pressure is not None and pressure[0] > limit:
        say(f"    the CPUs are busy with other work (PSI some avg10 {100 * pressure[0]:.0f} %);"
            f" waiting up to {timeout_s:g} s for them to calm down ...")
    while pressure is not None and pressure[0] > limit and time.monotonic() < deadline:
        await asyncio.sleep(2.0)
        pressure = cpu_pressure()


@dataclass
class _Replayed:
    outcomes: list[Outcome]
    replayer: Replayer
    watch: EngineWatch
    heartbeats: HeartbeatWatch
    before: dict[str, EngineSample]
    after: dict[str, EngineSample]
    host: dict[str, Any]


async def run_policy(testbed: Testbed, trace: Trace, scenario: Scenario, policy: str,
                     number: int, out: Path, say: Say, bar: ProgressBar,
                     wait_s: float = MAX_WAIT_S) -> dict[str, Any]:
    """One replay of the trace under `policy`; `number` salts its prompts. Returns the
    policy's summary (raw records go to OUT/requests/POLICY.jsonl). `wait_s` bounds each
    wait before the replay (for idle engines, for a calm machine)."""
    say(f"[{number + 1}] {policy}: routers restarting with --policy {policy} ...")
    await testbed.use(policy)
    engines = [EngineEndpoint(sim.name.removeprefix("sim-"), sim.region or "", str(sim.url))
               for sim in testbed.sims]
    watch = EngineWatch(engines)
    if not await watch.wait_idle(timeout_s=wait_s, quiet_s=3.0):
        say(f"[{number + 1}] {policy}: engines still busy after {wait_s:.0f} s; "
            "measuring anyway")
    builder = PromptBuilder(trace.header.get("model", scenario.model), salt=f"[{number:02d}] ")
    router_for = {origin: testbed.router_for(origin) for origin in scenario.regions}
    replayer = Replayer(trace.requests, builder.bodies(trace.requests), router_for,
                        duration_s=trace.duration_s, timeout_s=scenario.request_timeout_s)
    await wait_for_quiet(say, timeout_s=wait_s)
    noise = scenario.host_noise
    # Bounded past the replay's own bound (every request sent and timed out) plus margin.
    async with HostNoise(noise, max_s=trace.duration_s + replayer.late_s
                         + scenario.request_timeout_s + 30.0) as hogs:
        if hogs.pids:
            say(f"    host noise: {len(hogs.pids)} CPU hog(s) at duty {noise.duty:g} "
                f"(PIDs {', '.join(map(str, hogs.pids))})")
        replayed = await _replay(testbed, replayer, watch, policy, trace.duration_s, bar)
    replayed.host["host_noise"] = {"processes": noise.processes, "duty": noise.duty,
                                   "period_ms": noise.period_ms}
    write_jsonl(out / "requests" / f"{policy}.jsonl", [o.to_json() for o in replayed.outcomes])
    summary = _summarize(replayed, scenario, trace, engines, testbed)
    interactive = summary["interactive"]["ttft_ms"]
    say(f"[{number + 1}] {policy}: {summary['requests']} requests, {summary['errors']} errors; "
        f"interactive TTFT p50/p99 {interactive['p50']}/{interactive['p99']} ms; SLO "
        f"{_pct(summary['slo_attainment'])}; prefix hits {_pct(summary['prefix_hit_rate'])}; "
        f"loadgen lag p99 {summary['loadgen']['p99_ms']} ms")
    return summary


async def _replay(testbed: Testbed, replayer: Replayer, watch: EngineWatch, policy: str,
                  duration_s: float, bar: ProgressBar) -> _Replayed:
    load_before = os.getloadavg()[0]
    pressure_before = cpu_pressure()
    cpu_before = {**testbed.cpu_seconds_by_role(), "loadgen": time.process_time()}
    before = await watch.snapshot()
    replaying = asyncio.create_task(replayer.run())
    started = asyncio.create_task(replayer.started.wait())
    await asyncio.wait([replaying, started], return_when=asyncio.FIRST_COMPLETED)
    started.cancel()
    heartbeats = HeartbeatWatch(testbed.redis_url, KEY_PREFIX)
    watching = asyncio.create_task(watch.run(replayer.now_s))
    reading = asyncio.create_task(heartbeats.run(replayer.now_s))
    showing = asyncio.create_task(bar.follow(policy, replayer, duration_s))
    try:
        outcomes = await replaying
    finally:
        for task in (watching, reading, showing):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    bar.show(policy, replayer, duration_s, final=True)
    elapsed_s = replayer.now_s()
    pressure_after = cpu_pressure()
    cpu_after = {**testbed.cpu_seconds_by_role(), "loadgen": time.process_time()}
    host = {
        "host_load_1m": {"start": round(load_before, 2), "end": round(os.getloadavg()[0], 2)},
        "cpu_cores_used": {role: round((cpu_after[role] - cpu_before.get(role, 0.0))
                                       / elapsed_s, 3) for role in cpu_after},
        # Share of the run in which some runnable task on the machine waited for a CPU.
        "cpu_pressure": None if pressure_before is None or pressure_after is None else round(
            (pressure_after[1] - pressure_before[1]) / 1e6 / elapsed_s, 3),
        "exited_children": testbed.exited(),
    }
    return _Replayed(outcomes, replayer, watch, heartbeats, before, await watch.snapshot(),
                     host)


def _summarize(replayed: _Replayed, scenario: Scenario, trace: Trace,
               engines: Sequence[EngineEndpoint], testbed: Testbed) -> dict[str, Any]:
    outcomes, before, after = replayed.outcomes, replayed.before, replayed.after
    regions = list(scenario.regions)
    budgets = {r.index: r.ttft_budget_ms for r in trace.requests}

    def summary_of(subset: Sequence[Outcome]) -> dict[str, Any]:
        return stats.summarize(subset, slo_ms=scenario.interactive_ttft_slo_ms,
                               duration_s=trace.duration_s, regions=regions, budgets=budgets)

    summary = summary_of(outcomes)
    bins = stats.share_bins(outcomes, regions, trace.duration_s)
    summary.update({
        "prefix_hit_rate": _rate(prefix_hit_rate(before, after)),
        "prefix_hit_rate_by_region": {
            region: _rate(prefix_hit_rate(before, after,
                                          [e.name for e in engines if e.region == region]))
            for region in regions},
        "by_origin": {origin: summary_of([o for o in outcomes if o.origin == origin])
                      for origin in regions},
        "oscillation": stats.oscillation(bins, regions),
        "sync_bursts": stats.burst_placement(outcomes, sync_moments(scenario)),
        "heartbeats": replayed.heartbeats.summary(),
        "loadgen": stats.lag(outcomes, replayed.replayer.skipped),
        **replayed.host,
        "timeline": {"share_bins": bins, "engines": _engine_series(replayed.watch, engines)},
    })
    return summary


def _engine_series(watch: EngineWatch, engines: Sequence[EngineEndpoint]) -> dict[str, Any]:
    """Per region: running and waiting summed over its workers, at each poll."""
    regions = sorted({e.region for e in engines})
    region_of = {e.name: e.region for e in engines}
    t_s: list[float] = []
    running: dict[str, list[int]] = {r: [] for r in regions}
    waiting: dict[str, list[int]] = {r: [] for r in regions}
    for at, samples in watch.series:
        t_s.append(round(at, 2))
        for region in regions:
            running[region].append(sum(s.running for n, s in samples.items()
                                       if region_of.get(n) == region))
            waiting[region].append(sum(s.waiting for n, s in samples.items()
                                       if region_of.get(n) == region))
    return {"t_s": t_s, "running": running, "waiting": waiting}


def _rate(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def write_jsonl(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for row in rows:
            out.write(json.dumps(row, separators=(",", ":")) + "\n")
