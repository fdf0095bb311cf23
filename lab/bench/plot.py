"""The benchmark's PNGs (matplotlib, Agg backend; imported only when a report is written).

- `ttft_cdf.png`: CDF of interactive TTFT per policy, log scale, the SLO marked;
- `regions_over_time.png`: top, the demand offered by each origin region per second; then
  one row per policy: each region's engine load ((running + waiting) / batch slots, from
  the simulators' /metrics) and the share of requests each region served, per second.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def ttft_cdf_png(results: dict[str, Any], out: Path) -> None:
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(9, 5.5))
    for index, name in enumerate(results["policies"]):
        rows = _jsonl(out / "requests" / f"{name}.jsonl")
        ttfts = sorted((r["first_token_s"] - r["sent_s"]) * 1000.0 for r in rows
                       if r.get("traffic_class") == "interactive" and "failure" not in r
                       and "first_token_s" in r)
        if not ttfts:
            continue
        shares = [(i + 1) / len(ttfts) for i in range(len(ttfts))]
        axes.plot(ttfts, shares, label=name, color=_COLORS[index % len(_COLORS)],
                  linewidth=2.2 if name == "predicted_ttft" else 1.3)
    slo = results["scenario"]["interactive_ttft_slo_ms"]
    axes.axvline(slo, color="#d62728", linestyle="--", linewidth=1)
    axes.text(slo, 0.02, f" SLO {slo:g} ms", color="#d62728", fontsize=8)
    axes.set_xscale("log")
    axes.set_xlabel("interactive TTFT (ms, client at its region's router)")
    axes.set_ylabel("share of interactive requests")
    axes.set_ylim(0, 1.01)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(loc="lower right", fontsize=9)
    scenario = results["scenario"]
    axes.set_title(f"TTFT CDF, {scenario['name']}{' (quick)' if scenario['quick'] else ''}",
                   fontsize=10)
    figure.tight_layout()
    figure.savefig(out / "ttft_cdf.png", dpi=110)
    plt.close(figure)


def regions_png(results: dict[str, Any], out: Path) -> None:
    plt = _pyplot()
    policies = list(results["policies"])
    regions = list(results["scenario"]["regions"])
    color = {region: _COLORS[i % len(_COLORS)] for i, region in enumerate(regions)}
    duration = float(results["scenario"]["duration_s"])
    figure, grid = plt.subplots(len(policies) + 1, 2, figsize=(13, 2.3 * (len(policies) + 1)),
                                sharex=True, squeeze=False)
    _demand_row(grid[0], out, regions, color, duration, results)
    slots = results["scenario"]["engine"]["max_num_seqs"]
    for row, name in zip(grid[1:], policies, strict=True):
        run = results["policies"][name]
        engines = run["timeline"]["engines"]
        load_ax, share_ax = row
        for region in regions:
            workers = results["scenario"]["regions"][region]["workers"]
            load = [(r + w) / (workers * slots) for r, w in
                    zip(engines["running"].get(region, []), engines["waiting"].get(region, []),
                        strict=True)]
            load_ax.plot(engines["t_s"], load, color=color[region], linewidth=1.2, label=region)
        load_ax.axhline(1.0, color="#999999", linewidth=0.8, linestyle=":")
        load_ax.set_ylabel(f"{name}\nload", fontsize=8)
        bins = run["timeline"]["share_bins"]
        t = [b["t_s"] + 0.5 for b in bins]
        bottoms = [0.0] * len(bins)
        for region in regions:
            shares = [100.0 * b["served"][region] / b["requests"] if b["requests"] else 0.0
                      for b in bins]
            share_ax.bar(t, shares, width=1.0, bottom=bottoms, color=color[region],
                         linewidth=0)
            bottoms = [b + s for b, s in zip(bottoms, shares, strict=True)]
        share_ax.set_ylim(0, 100)
        share_ax.set_ylabel("served %", fontsize=8)
    grid[1][0].set_title("engine load per region: (running + waiting) / batch slots",
                         fontsize=9)
    grid[1][1].set_title("share of requests served by each region, per second", fontsize=9)
    for axes in grid[-1]:
        axes.set_xlabel("seconds since the replay started")
    grid[0][0].legend(loc="upper left", fontsize=8, ncol=len(regions))
    figure.tight_layout()
    figure.savefig(out / "regions_over_time.png", dpi=100)
    plt.close(figure)


def _demand_row(row: Any, out: Path, regions: list[str], color: dict[str, str],
                duration: float, results: dict[str, Any]) -> None:
    demand_ax, note_ax = row
    requests = _jsonl(out / "trace.jsonl")[1:]
    seconds = max(1, int(duration + 0.999))
    capacity = results["trace"]["region_capacity_rps"]
    for region in regions:
        counts = [0] * seconds
        for request in requests:
            if request["origin"] == region:
                counts[min(seconds - 1, int(request["at_s"]))] += 1
        demand_ax.step([s + 0.5 for s in range(seconds)], counts, where="mid",
                       color=color[region], label=region, linewidth=1.2)
        demand_ax.axhline(capacity[region], color=color[region], linewidth=0.6, linestyle=":")
    demand_ax.set_ylabel("offered\nreq/s", fontsize=8)
    demand_ax.set_title("demand by origin region (dotted: each region's capacity)", fontsize=9)
    note_ax.axis("off")
    note_ax.text(0.0, 0.5, f"{results['scenario']['name']}: {results['trace']['requests']} "
                 f"requests, {results['trace']['offered_rps']} req/s offered\n"
                 f"= {100 * results['trace']['offered_share_of_capacity']:.0f} % of fleet "
                 f"capacity; SLO {results['scenario']['interactive_ttft_slo_ms']:g} ms",
                 fontsize=9, va="center")
