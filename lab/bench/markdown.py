"""report.md: the tables a person reads, rendered from results.json."""

from __future__ import annotations

from typing import Any


def _ms(value: Any) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _index(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}"


def _pct(value: Any) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def _shares(shares: dict[str, Any]) -> str:
    return " / ".join(f"{100 * v:.0f}" if v is not None else "-" for v in shares.values())


def _error(found: dict[str, Any] | None) -> str:
    """Prediction error p50 / p90 (%) and how many requests had a prediction."""
    if not found:
        return "-"
    if not found.get("count"):
        return f"none predicted (0 / {found.get('eligible', 0)})"
    return (f"{_pct(found['p50_abs'])} / {_pct(found['p90_abs'])} "
            f"({found['count']} / {found['eligible']})")


def _cpu(used: dict[str, float]) -> str:
    total = sum(used.values())
    parts = ", ".join(f"{role} {cores:.2f}" for role, cores in sorted(used.items()))
    return f"{total:.2f} ({parts})"


def policy_table(results: dict[str, Any]) -> list[str]:
    regions = list(results["scenario"]["regions"])
    lines = [
        "| policy | requests | errors | interactive TTFT p50 / p90 / p99 (ms) | all TTFT p99 "
        "(ms) | ITL p50 / p99 (ms) | e2e p99 (ms) | SLO attainment | goodput (req/s) | "
        f"prefix hits | served % ({' / '.join(regions)}) | served at home | prediction "
        "error p50 / p90 (predicted / eligible) | oscillation index / swings |",
        "|---|---:|---:|---|---:|---|---:|---:|---:|---:|---|---:|---|---|",
    ]
    for name, run in results["policies"].items():
        ttft = run["interactive"]["ttft_ms"]
        wave = run["oscillation"]
        lines.append(
            f"| `{name}` | {run['requests']} | {run['errors']} | {_ms(ttft['p50'])} / "
            f"{_ms(ttft['p90'])} / **{_ms(ttft['p99'])}** | {_ms(run['ttft_ms']['p99'])} | "
            f"{_ms(run['itl_ms']['p50'])} / {_ms(run['itl_ms']['p99'])} | "
            f"{_ms(run['e2e_ms']['p99'])} | **{_pct(run['slo_attainment'])}** | "
            f"{run['goodput_rps']:.1f} | {_pct(run['prefix_hit_rate'])} | "
            f"{_shares(run['traffic_share'])} | {_pct(run.get('home_share'))} | "
            f"{_error(run.get('prediction_error'))} | {_index(wave['index'])} / "
            f"{wave['swings']} |")
    return lines


def twin_table(results: dict[str, Any]) -> list[str]:
    lines = [
        "| policy | interactive TTFT p50 / p90 / p99 (ms) | SLO attainment | prefix hits | "
        "served at home | prediction error p50 / p90 (predicted / eligible) | ITL p50 (ms) | "
        "test bed: p99 / SLO / ITL p50 |",
        "|---|---|---:|---:|---:|---|---:|---|",
    ]
    for name, run in results.get("twin", {}).items():
        ttft = run["interactive"]["ttft_ms"]
        measured = results["policies"].get(name)
        on_bed = ("-" if measured is None else
                  f"{_ms(measured['interactive']['ttft_ms']['p99'])} ms / "
                  f"{_pct(measured['slo_attainment'])} / {_ms(measured['itl_ms']['p50'])} ms")
        lines.append(f"| `{name}` | {_ms(ttft['p50'])} / {_ms(ttft['p90'])} / "
                     f"{_ms(ttft['p99'])} | {_pct(run['slo_attainment'])} | "
                     f"{_pct(run['prefix_hit_rate'])} | {_pct(run.get('home_share'))} | "
                     f"{_error(run.get('prediction_error'))} | "
                     f"{_ms(run.get('itl_ms', {}).get('p50'))} | "
                     f"{on_bed} |")
    return lines


def oracle_table(results: dict[str, Any]) -> list[str]:
    """Every policy against the oracle: on the twin (the same model) and on the test bed
    (the machine added). P99 as a multiple of the oracle's; SLO as points below it."""
    oracle = results.get("twin", {}).get("oracle")
    if oracle is None or not oracle["interactive"]["ttft_ms"]["p99"]:
        return ["(no oracle run)"]
    p99, slo = oracle["interactive"]["ttft_ms"]["p99"], oracle["slo_attainment"]

    def against(run: dict[str, Any] | None) -> str:
        if run is None or run["interactive"]["ttft_ms"]["p99"] is None:
            return "-"
        points = "-" if run["slo_attainment"] is None or slo is None else \
            f"{100 * (run['slo_attainment'] - slo):+.1f}"
        return f"{run['interactive']['ttft_ms']['p99'] / p99:.2f}x / {points}"

    lines = [f"Oracle (twin): interactive P99 {_ms(p99)} ms, SLO {_pct(slo)}.", "",
             "| policy | twin: P99 / SLO points vs oracle | test bed: P99 / SLO points vs "
             "oracle |", "|---|---|---|"]
    for name in results["policies"]:
        lines.append(f"| `{name}` | {against(results['twin'].get(name))} | "
                     f"{against(results['policies'][name])} |")
    return lines


def burst_table(results: dict[str, Any]) -> list[str]:
    """Where each policy put the requests of a synchronized burst (test bed and twin)."""
    lines = ["| policy | most of a burst on one worker: mean / worst (test bed) | burst TTFT "
             "p50 / p90 (ms, test bed) | twin: mean / worst | twin: burst TTFT p50 / p90 |",
             "|---|---|---|---|---|"]
    names = list(dict.fromkeys([*results["policies"], *results.get("twin", {})]))
    for name in names:
        cells = []
        for run in (results["policies"].get(name), results.get("twin", {}).get(name)):
            found = (run or {}).get("sync_bursts")
            if not found:
                cells += ["-", "-"]
                continue
            cells += [f"{found['max_on_one_worker_mean']:g} / {found['max_on_one_worker']} "
                      f"of {found['requests_per_burst']}",
                      f"{_ms(found['ttft_ms']['p50'])} / {_ms(found['ttft_ms']['p90'])}"]
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return lines


def _burst_section(results: dict[str, Any]) -> list[str]:
    scenario = results["scenario"]
    sync = scenario.get("sync_bursts") or {}
    if not sync.get("at"):
        return []
    burst = sync["requests"] * len(scenario["regions"])
    workers = sum(spec["workers"] for spec in scenario["regions"].values())
    return ["## Synchronized bursts", "",
            f"Each burst: {burst} requests at one instant; spread evenly, {burst / workers:g} "
            f"per worker ({workers} workers of {scenario['engine']['max_num_seqs']} slots).",
            "", *burst_table(results), ""]


def origin_table(results: dict[str, Any]) -> list[str]:
    regions = list(results["scenario"]["regions"])
    header = " | ".join(f"{r}: p99 / SLO / served here" for r in regions)
    lines = [f"| policy | {header} |", "|---|" + "---|" * len(regions)]
    for name, run in results["policies"].items():
        cells = []
        for origin in regions:
            sub = run["by_origin"][origin]
            home = sub["traffic_share"].get(origin)
            cells.append(f"{_ms(sub['interactive']['ttft_ms']['p99'])} ms / "
                         f"{_pct(sub['slo_attainment'])} / {_pct(home)}")
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return lines


def _conditions(scenario: dict[str, Any]) -> list[str]:
    """Lines for what a scenario adds to the standard test bed (speeds, bursts, noise)."""
    lines = []
    speeds = {name: spec.get("speed", 1.0) for name, spec in scenario["regions"].items()}
    if any(speed != 1.0 for speed in speeds.values()):
        lines.append("- engine speed per region: " + ", ".join(
            f"{name} {speed:g}x" for name, speed in speeds.items()))
    sync = scenario.get("sync_bursts") or {}
    if sync.get("at"):
        lines.append(f"- synchronized bursts: {sync['requests']} requests to every origin's "
                     f"router at once, at {', '.join(f'{a:g}' for a in sync['at'])} of the run")
    noise = scenario.get("host_noise") or {}
    if noise.get("processes"):
        lines.append(f"- host noise: {noise['processes']} CPU hog(s) busy {noise['duty']:g} of "
                     f"every {noise['period_ms']:g} ms during each measured run (the twin "
                     "has no CPU: it is the no-noise reference)")
    return lines


def render(results: dict[str, Any]) -> str:
    scenario = results["scenario"]
    trace = results["trace"]
    bed = results["test_bed"]
    lines = [
        f"# globalpool bench: {scenario['name']}{' (quick)' if scenario['quick'] else ''}",
        "",
        scenario["description"],
        "",
        f"- trace: {trace['requests']} requests over {scenario['duration_s']:g} s "
        f"({trace['offered_rps']} req/s = {_pct(trace['offered_share_of_capacity'])} of the "
        f"fleet's capacity of {sum(trace['region_capacity_rps'].values()):.1f} req/s; "
        f"{trace['worker_capacity_rps']} req/s per worker at saturation), seed {trace['seed']}",
        f"- interactive TTFT target: {scenario['interactive_ttft_slo_ms']:g} ms; "
        f"{bed['router_replicas']} router replicas ({', '.join(bed['router_regions'])}) "
        "sharing one Redis",
        *_conditions(scenario),
        f"- command: `{results['command']}`",
        "",
        "## Per policy",
        "",
        *policy_table(results),
        "",
        "## Per origin region (interactive TTFT p99, SLO attainment, share served in the "
        "origin's own region)",
        "",
        *origin_table(results),
        "",
        "## The same trace on the virtual-time twin (no machine)",
        "",
        "The simulator's engine model on one virtual clock, the real policy classes, RTTs as "
        "delays, heartbeats from the engines' state every interval (lab/bench/twin.py). "
        "`oracle` scores like predicted_ttft (RTT + queue wait + uncached prefill + first "
        "step) from every engine's exact state at every decision (its queue, its prefix "
        "cache, its speed): a reference for what is reachable on this trace. Its score is "
        "its prediction.",
        "",
        *twin_table(results),
        "",
        "## Against the oracle",
        "",
        *oracle_table(results),
        "",
        *_burst_section(results),
        "## Goals",
        "",
    ]
    for goal in results["goals"]:
        mark = {True: "met", False: "**missed**", None: "not run"}[goal["met"]]
        lines.append(f"- {mark}: {goal['goal']} (measured: {goal['measured']})")
    lines += ["", "## Load generator and host", ""]
    for name, run in results["policies"].items():
        lag = run["loadgen"]
        load = run["host_load_1m"]
        if run.get("disturbed"):
            lines.append(f"- **`{name}` was disturbed by the machine** (the load generator "
                         "fell behind in every attempt): read its latencies with care")
        tries = len(run.get("attempts", [None]))
        lines.append(f"- `{name}` ({tries} attempt(s)): send lag p50 {lag['p50_ms']} ms, "
                     f"p99 {lag['p99_ms']} ms, "
                     f"max {lag['max_ms']} ms, skipped {lag['skipped']}; host load (1 min) "
                     f"{load['start']} -> {load['end']} on {results['host']['cpus']} CPUs, "
                     f"CPU pressure {_pct(run.get('cpu_pressure'))}; "
                     f"CPU cores used by the test bed: {_cpu(run.get('cpu_cores_used', {}))}; "
                     f"routes: {', '.join(f'{k} {v}' for k, v in run['routes'].items())}")
    lines += ["", "## Definitions", ""]
    lines += [f"- `{name}`: {text}" for name, text in results["definitions"].items()]
    lines += ["", f"- test bed: {bed['network']}", "",
              "Plots: `ttft_cdf.png`, `regions_over_time.png`, `prediction_error.png`.", ""]
    return "\n".join(lines)
