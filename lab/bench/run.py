"""`globalpool bench`: one trace, replayed against every policy on the same test bed.

    trace (generated from the scenario, or --trace F) -> test bed up ->
    for each policy: routers restarted with it -> engines idle -> replay -> measure
    -> test bed down -> results.json, report.md, PNGs

Every policy gets fresh router replicas and idle engines, and its prompts carry a salt of
their own (same length), so no policy finds the previous one's prefixes in an engine's
cache (lab.bench.trace.PromptBuilder). Restarting the simulators and agents for each
policy would cost a dozen process starts per policy on a 2-core machine and change
nothing that matters.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab.bench import stats
from lab.bench.measure import MAX_WAIT_S, run_policy, write_jsonl
from lab.bench.progress import ProgressBar
from lab.bench.scenario import Scenario, load_scenario, resolve
from lab.bench.testbed import Testbed
from lab.bench.trace import Trace
from lab.bench.twin import ORACLE, Twin
from lab.bench.workload import generate, sync_moments

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
    attempts: int = 2  # runs of a policy when the machine disturbed the first
    hedge: float = 0.0  # router.hedging.max_fraction for interactive streams (0: none)
    command: str = ""
    # Wall-clock bound on the test bed's part (None: none): waits shrink and reruns are
    # skipped so that the runs end within it (see `_with_attempts`).
    time_limit_s: float | None = None


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


async def run_bench(options: BenchOptions, say: Say, bar: ProgressBar | None = None
                    ) -> dict[str, Any]:
    """Run the benchmark end to end; returns the results (also written under `out`)."""
    from lab.bench.report import build_results, write_outputs

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
    say("virtual-time twin (the same trace without the machine): "
        + ", ".join((*options.policies, ORACLE)) + " ...")
    twin = await asyncio.to_thread(twin_reference, scenario, trace, options.policies, replicas,
                                   options.out)
    testbed = Testbed(scenario, options.out, replicas, say, hedge=options.hedge)
    runs: dict[str, dict[str, Any]] = {}
    started = time.monotonic()
    deadline_s = None if options.time_limit_s is None else started + options.time_limit_s
    await testbed.start(options.policies[0])
    say(f"test bed up in {time.monotonic() - started:.1f} s: routers "
        + ", ".join(f"{region} {testbed.router_for(region)}" for region in testbed.router_regions))
    try:
        salts = iter(range(10_000))
        for index, policy in enumerate(options.policies):
            budget = _Budget(deadline_s, policies_after=len(options.policies) - index - 1)
            runs[policy] = await _with_attempts(testbed, trace, scenario, policy, salts,
                                                options, say, bar, budget)
    finally:
        say("stopping the test bed ...")
        await testbed.stop()
    results = build_results(scenario=scenario, scenario_file=scenario_file, trace=trace,
                            runs=runs, twin=twin, replicas=replicas,
                            router_regions=testbed.router_regions, quick=options.quick,
                            command=options.command, stuck_routers=testbed.stuck_routers)
    write_outputs(options.out, results)
    return results


@dataclass(frozen=True)
class _Budget:
    """What is left of `--time-limit` for one policy: its share of the time to the
    deadline (the policies after it need theirs), and whether a rerun still fits."""

    deadline_s: float | None
    policies_after: int

    def share_s(self) -> float | None:
        if self.deadline_s is None:
            return None
        return (self.deadline_s - time.monotonic()) / (self.policies_after + 1)

    def wait_s(self, run_s: float) -> float:
        """The bound on each wait before a replay that takes about `run_s` (at least a
        few seconds: a replay on busy engines is still a measurement, marked as such)."""
        share = self.share_s()
        if share is None:
            return MAX_WAIT_S
        return max(5.0, min(MAX_WAIT_S, (share - run_s) / 2))

    def fits(self, run_s: float) -> bool:
        share = self.share_s()
        return share is None or share >= run_s


async def _with_attempts(testbed: Testbed, trace: Trace, scenario: Scenario, policy: str,
                         salts: Iterator[int], options: BenchOptions, say: Say,
                         bar: ProgressBar, budget: _Budget) -> dict[str, Any]:
    """Run `policy`, again (up to `options.attempts` in all, and while `budget` has the
    time) while the machine disturbs it; the last run counts, and says how many there
    were."""
    attempts: list[dict[str, Any]] = []
    run_s = trace.duration_s + 30.0  # a first guess: restart, replay, stragglers
    while True:
        started = time.monotonic()
        run = await run_policy(testbed, trace, scenario, policy, next(salts), options.out,
                               say, bar, wait_s=budget.wait_s(run_s))
        run_s = time.monotonic() - started
        say(f"    {policy}: took {run_s:.0f} s")
        attempts.append({"loadgen": run["loadgen"], "host_load_1m": run["host_load_1m"],
                         "cpu_pressure": run["cpu_pressure"], "disturbed": disturbed(run),
                         "took_s": round(run_s, 1)})
        if not disturbed(run) or len(attempts) >= options.attempts:
            break
        if scenario.host_noise.processes:
            break  # the scenario's own CPU hogs disturb it on purpose: a rerun would too
        if not budget.fits(run_s):
            say(f"    {policy}: the load generator fell behind (the machine stalled); no "
                "time left under --time-limit to run it again")
            break
        say(f"    {policy}: the load generator fell behind (send lag p99 "
            f"{run['loadgen']['p99_ms']} ms, max {run['loadgen']['max_ms']} ms): the "
            "machine stalled; running this policy again")
    run["disturbed"] = disturbed(run)
    run["attempts"] = attempts
    return run


def twin_reference(scenario: Scenario, trace: Trace, policies: Sequence[str], replicas: int,
                   out: Path | None = None) -> dict[str, dict[str, Any]]:
    """Each policy (and the oracle) on the virtual-time twin of the test bed; with `out`,
    each one's per-request records go to OUT/twin/POLICY.jsonl."""
    regions = list(scenario.regions)
    found: dict[str, dict[str, Any]] = {}
    for policy in (*policies, ORACLE):
        result = Twin(scenario, trace, policy, one_router=replicas == 1).run()
        if out is not None:
            write_jsonl(out / "twin" / f"{policy}.jsonl", [o.to_json() for o in result.outcomes])
        summary = stats.summarize(result.outcomes, slo_ms=scenario.interactive_ttft_slo_ms,
                                  duration_s=trace.duration_s, regions=regions)
        found[policy] = {key: summary[key] for key in (
            "requests", "errors", "ttft_ms", "itl_ms", "interactive", "slo_attainment",
            "goodput_rps", "traffic_share", "routes", "home_share", "prediction_error")}
        found[policy]["prefix_hit_rate"] = (None if result.prefix_hit_rate is None
                                            else round(result.prefix_hit_rate, 4))
        bins = stats.share_bins(result.outcomes, regions, trace.duration_s)
        found[policy]["oscillation"] = stats.oscillation(bins, regions)
        found[policy]["sync_bursts"] = stats.burst_placement(result.outcomes,
                                                             sync_moments(scenario))
    return found


# A run whose load generator sent this late was disturbed by the machine (another process
# took the CPUs): its latencies say more about the machine than about routing.
DISTURBED_LAG_P99_MS = 100.0
DISTURBED_LAG_MAX_MS = 1000.0


def disturbed(run: dict[str, Any]) -> bool:
    lag = run["loadgen"]
    return bool((lag["p99_ms"] or 0.0) > DISTURBED_LAG_P99_MS
                or (lag["max_ms"] or 0.0) > DISTURBED_LAG_MAX_MS)


