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


def _cpu(used: dict[str, float]) -> str:
    total = sum(used.values())
    parts = ", ".join(f"{role} {cores:.2f}" for role, cores in sorted(used.items()))
    return f"{total:.2f} ({parts})"


def policy_table(results: dict[str, Any]) -> list[str]:
    regions = list(results["scenario"]["regions"])
    lines = [
        "| policy | requests | errors | interactive TTFT p50 / p90 / p99 (ms) | all TTFT p99 "
        "(ms) | ITL p50 / p99 (ms) | e2e p99 (ms) | SLO attainment | goodput (req/s) | "
        f"prefix hits | served % ({' / '.join(regions)}) | oscillation index / swings |",
        "|---|---:|---:|---|---:|---|---:|---:|---:|---:|---|---|",
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
            f"{_shares(run['traffic_share'])} | {_index(wave['index'])} / {wave['swings']} |")
    return lines


def twin_table(results: dict[str, Any]) -> list[str]:
    lines = [
        "| policy | interactive TTFT p50 / p90 / p99 (ms) | SLO attainment | prefix hits | "
        "ITL p50 (ms) | test bed: p99 / SLO / ITL p50 |",
        "|---|---|---:|---:|---:|---|",
    ]
    for name, run in results.get("twin", {}).items():
        ttft = run["interactive"]["ttft_ms"]
        measured = results["policies"].get(name)
        on_bed = ("-" if measured is None else
                  f"{_ms(measured['interactive']['ttft_ms']['p99'])} ms / "
                  f"{_pct(measured['slo_attainment'])} / {_ms(measured['itl_ms']['p50'])} ms")
        lines.append(f"| `{name}` | {_ms(ttft['p50'])} / {_ms(ttft['p90'])} / "
                     f"{_ms(ttft['p99'])} | {_pct(run['slo_attainment'])} | "
                     f"{_pct(run['prefix_hit_rate'])} | "
                     f"{_ms(run.get('itl_ms', {}).get('p50'))} | "
                     f"{on_bed} |")
    return lines


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
        "`oracle` scores like predicted_ttft from every engine's exact state at every "
        "decision: a reference for what is reachable on this trace.",
        "",
        *twin_table(results),
        "",
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
              "Plots: `ttft_cdf.png`, `regions_over_time.png`.", ""]
    return "\n".join(lines)
