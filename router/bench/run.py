"""`globalpool bench`: one trace, replayed against every policy on the same test bed.

    trace (generated from the scenario, or --trace F) -> test bed up ->
    for each policy: routers restarted with it -> engines idle -> replay -> measure
    -> test bed down -> results.json, report.md, PNGs

Every policy gets fresh router replicas and idle engines, and its prompts carry a salt of
their own (same length), so no policy finds the previous one's prefixes in an engine's
cache (router.bench.trace.PromptBuilder). Restarting the simulators and agents for each
policy would cost a dozen process starts per policy on a 2-core machine and change
nothing that matters.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from router.bench import stats
from router.bench.heartbeats import HeartbeatWatch
from router.bench.observe import Engine, EngineWatch, prefix_hit_rate
from router.bench.replay import Replayer
from router.bench.scenario import Scenario, load_scenario, resolve
from router.bench.testbed import KEY_PREFIX, Testbed
from router.bench.trace import PromptBuilder, Trace
from router.bench.workload import generate

Say = Callable[[str], None]


@dataclass(frozen=True)
class BenchOptions:
    scenario: str
    policies: tuple[str, ...]
    out: Path
    quick: bool = False
    replicas: int | None = None
    trace_path: Path | None = None
    save_trace: Path | None = None
    seed: int | None = None
    command: str = ""


def load_trace(options: BenchOptions, scenario: Scenario) -> Trace:
    """The trace to replay: the file given, or a new one from the (unshortened) scenario."""
    if options.trace_path is None:
        return generate(scenario, seed=options.seed, quick=options.quick)
    trace = Trace.load(options.trace_path)
    unknown = {r.origin for r in trace.requests} - set(scenario.regions)
    if unknown:
        raise ValueError(f"{options.trace_path}: origins {sorted(unknown)} are not regions "
                         f"of scenario {scenario.name}")
    return trace


class ProgressBar:
    """A one-line text bar on stderr (a line every few seconds when not a terminal)."""

    def __init__(self, stream: TextIO = sys.stderr, width: int = 30) -> None:
        self.stream = stream
        self.width = width
        self.tty = stream.isatty()
        self._last_line_s = 0.0

    def show(self, label: str, replayer: Replayer, duration_s: float, final: bool = False
             ) -> None:
        now = replayer.now_s()
        done = min(1.0, now / duration_s) if duration_s > 0 else 1.0
        filled = int(done * self.width)
        errors = sum(not o.ok for o in replayer.outcomes)
        line = (f"{label:<16} [{'#' * filled}{'.' * (self.width - filled)}] {100 * done:3.0f}% "
                f"t={now:5.1f}/{duration_s:g}s sent {replayer.sent} open {replayer.in_flight} "
                f"done {len(replayer.outcomes)} errors {errors}")
        if self.tty:
            self.stream.write("\r" + line + ("\n" if final else ""))
            self.stream.flush()
        elif final or time.monotonic() - self._last_line_s >= 5.0:
            self._last_line_s = time.monotonic()
            print(line, file=self.stream, flush=True)

    async def follow(self, label: str, replayer: Replayer, duration_s: float) -> None:
        while True:
            self.show(label, replayer, duration_s)
            await asyncio.sleep(0.5)


async def run_bench(options: BenchOptions, say: Say, bar: ProgressBar | None = None
                    ) -> dict[str, Any]:
    """Run the benchmark end to end; returns the results (also written under `out`)."""
    from router.bench.report import build_results, write_outputs

    bar = bar or ProgressBar()
    scenario_file = resolve(options.scenario)
    base = load_scenario(options.scenario)
    scenario = base.quick_variant() if options.quick else base
    options.out.mkdir(parents=True, exist_ok=True)
    trace = await asyncio.to_thread(load_trace, options, base)  # capacity runs its own loop
    trace.save(options.out / "trace.jsonl")
    if options.save_trace is not None:
        trace.save(options.save_trace)
    header = trace.header
    say(f"bench {scenario.name}{' (quick)' if options.quick else ''}: {len(trace.requests)} "
        f"requests over {trace.duration_s:g} s ({header.get('offered_rps')} req/s, "
        f"{100 * float(header.get('offered_share_of_capacity', 0)):.0f} % of the fleet's "
        f"capacity); policies: {', '.join(options.policies)}; out: {options.out}")
    replicas = options.replicas or len(scenario.regions)
    testbed = Testbed(scenario, options.out, replicas, say)
    runs: dict[str, dict[str, Any]] = {}
    started = time.monotonic()
    await testbed.start(options.policies[0])
    say(f"test bed up in {time.monotonic() - started:.1f} s: routers "
        + ", ".join(f"{region} {testbed.router_for(region)}" for region in testbed.router_regions))
    try:
        for number, policy in enumerate(options.policies):
            runs[policy] = await _run_policy(testbed, trace, scenario, policy, number,
                                             options.out, say, bar)
    finally:
        say("stopping the test bed ...")
        await testbed.stop()
    results = build_results(scenario=scenario, scenario_file=scenario_file, trace=trace,
                            runs=runs, replicas=replicas,
                            router_regions=testbed.router_regions, quick=options.quick,
                            command=options.command)
    write_outputs(options.out, results)
    return results


async def _run_policy(testbed: Testbed, trace: Trace, scenario: Scenario, policy: str,
                      number: int, out: Path, say: Say, bar: ProgressBar) -> dict[str, Any]:
    say(f"[{number + 1}] {policy}: routers restarting with --policy {policy} ...")
    await testbed.use(policy)
    engines = [Engine(sim.name.removeprefix("sim-"), sim.region or "", str(sim.url))
               for sim in testbed.sims]
    watch = EngineWatch(engines)
    if not await watch.wait_idle(timeout_s=120.0, quiet_s=3.0):
        say(f"[{number + 1}] {policy}: engines still busy after 120 s; measuring anyway")
    builder = PromptBuilder(trace.header.get("model", scenario.model), salt=f"[{number:02d}] ")
    bodies = builder.bodies(trace.requests)
    router_for = {origin: testbed.router_for(origin) for origin in scenario.regions}
    replayer = Replayer(trace.requests, bodies, router_for, duration_s=trace.duration_s,
                        timeout_s=scenario.request_timeout_s)
    load_before = os.getloadavg()[0]
    cpu_before = {**testbed.cpu_seconds_by_role(), "loadgen": time.process_time()}
    before = await watch.snapshot()
    replaying = asyncio.create_task(replayer.run())
    started = asyncio.create_task(replayer.started.wait())
    await asyncio.wait([replaying, started], return_when=asyncio.FIRST_COMPLETED)
    started.cancel()
    heartbeats = HeartbeatWatch(testbed.redis_url, KEY_PREFIX)
    watching = asyncio.create_task(watch.run(replayer.now_s))
    reading = asyncio.create_task(heartbeats.run(replayer.now_s))
    showing = asyncio.create_task(bar.follow(policy, replayer, trace.duration_s))
    try:
        outcomes = await replaying
    finally:
        for task in (watching, reading, showing):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    bar.show(policy, replayer, trace.duration_s, final=True)
    elapsed_s = replayer.now_s()
    cpu_after = {**testbed.cpu_seconds_by_role(), "loadgen": time.process_time()}
    after = await watch.snapshot()
    _write_jsonl(out / "requests" / f"{policy}.jsonl", [o.to_json() for o in outcomes])
    regions = list(scenario.regions)
    budgets = {r.index: r.ttft_budget_ms for r in trace.requests}
    summary = stats.summarize(outcomes, slo_ms=scenario.interactive_ttft_slo_ms,
                              duration_s=trace.duration_s, regions=regions, budgets=budgets)
    bins = stats.share_bins(outcomes, regions, trace.duration_s)
    summary.update({
        "prefix_hit_rate": _rate(prefix_hit_rate(before, after)),
        "prefix_hit_rate_by_region": {
            region: _rate(prefix_hit_rate(before, after,
                                          [e.name for e in engines if e.region == region]))
            for region in regions},
        "by_origin": {
            origin: stats.summarize([o for o in outcomes if o.origin == origin],
                                    slo_ms=scenario.interactive_ttft_slo_ms,
                                    duration_s=trace.duration_s, regions=regions,
                                    budgets=budgets)
            for origin in regions},
        "oscillation": stats.oscillation(bins, regions),
        "heartbeats": heartbeats.summary(),
        "loadgen": stats.lag(outcomes, replayer.skipped),
        "host_load_1m": {"start": round(load_before, 2), "end": round(os.getloadavg()[0], 2)},
        "cpu_cores_used": {role: round((cpu_after[role] - cpu_before.get(role, 0.0))
                                       / elapsed_s, 3) for role in cpu_after},
        "exited_children": testbed.exited(),
        "timeline": {"share_bins": bins, "engines": _engine_series(watch, engines)},
    })
    interactive = summary["interactive"]["ttft_ms"]
    say(f"[{number + 1}] {policy}: {summary['requests']} requests, {summary['errors']} errors; "
        f"interactive TTFT p50/p99 {interactive['p50']}/{interactive['p99']} ms; SLO "
        f"{_pct(summary['slo_attainment'])}; prefix hits {_pct(summary['prefix_hit_rate'])}; "
        f"loadgen lag p99 {summary['loadgen']['p99_ms']} ms")
    return summary


def _engine_series(watch: EngineWatch, engines: Sequence[Engine]) -> dict[str, Any]:
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


def _write_jsonl(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for row in rows:
            out.write(json.dumps(row, separators=(",", ":")) + "\n")
