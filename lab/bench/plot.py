"""The benchmark's PNGs (matplotlib, Agg backend; imported only when a report is written).

- `ttft_cdf.png`: CDF of interactive TTFT per policy, log scale, the SLO marked;
- `prediction_error.png`: measured vs predicted TTFT, and the error CDF per policy;
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


def _predicted_pairs(path: Path) -> list[tuple[float, float]]:
    """(predicted, measured) ms of the successful interactive requests with a prediction
    in a per-request file (stats.prediction_error's population)."""
    if not path.is_file():
        return []
    pairs = []
    for row in _jsonl(path):
        predicted = row.get("predicted_ttft_ms")
        if (row.get("traffic_class") != "interactive" or "failure" in row
                or "first_token_s" not in row or not predicted or predicted <= 0):
            continue
        measured = (row["first_token_s"] - row["sent_s"]) * 1000.0 - row.get("unpredicted_ms", 0.0)
        if measured > 0:
            pairs.append((float(predicted), measured))
    return pairs


def prediction_error_png(results: dict[str, Any], out: Path) -> None:
    """Left: measured vs predicted TTFT on the test bed, per policy; right: the CDF of
    |measured - predicted| / measured, test bed solid, twin dashed (oracle included)."""
    plt = _pyplot()
    figure, (scatter_ax, cdf_ax) = plt.subplots(1, 2, figsize=(13, 5.5))
    names = list(dict.fromkeys([*results["policies"], *results.get("twin", {})]))
    for index, name in enumerate(names):
        color = _COLORS[index % len(_COLORS)]
        bed = _predicted_pairs(out / "requests" / f"{name}.jsonl")
        if bed:
            scatter_ax.scatter([p for p, _ in bed], [m for _, m in bed], s=6, alpha=0.5,
                               color=color, label=name)
        for pairs, style, where in ((bed, "-", "test bed"),
                                    (_predicted_pairs(out / "twin" / f"{name}.jsonl"), "--",
                                     "twin")):
            errors = sorted(abs(m - p) / m for p, m in pairs)
            if errors:
                cdf_ax.plot(errors, [(i + 1) / len(errors) for i in range(len(errors))],
                            style, color=color, label=f"{name} ({where})", linewidth=1.3)
    top = scatter_ax.get_xlim()[1] if scatter_ax.collections else 1.0
    scatter_ax.plot([1, top], [1, top], color="#999999", linewidth=0.8, linestyle=":")
    scatter_ax.set_xscale("log")
    scatter_ax.set_yscale("log")
    scatter_ax.set_xlabel("predicted TTFT (ms, x-globalpool-predicted-ttft-ms)")
    scatter_ax.set_ylabel("measured (ms): client TTFT - server-timing queue, retry")
    scatter_ax.set_title("test bed: measured vs predicted (dotted: equal)", fontsize=9)
    cdf_ax.set_xscale("symlog", linthresh=0.1)
    cdf_ax.set_xlabel("|measured - predicted| / measured")
    cdf_ax.set_ylabel("share of predicted interactive requests")
    cdf_ax.set_ylim(0, 1.01)
    cdf_ax.set_title("prediction error CDF (solid: test bed, dashed: twin)", fontsize=9)
    for axes in (scatter_ax, cdf_ax):
        axes.grid(True, which="both", alpha=0.3)
        if axes.lines or axes.collections:
            axes.legend(loc="lower right", fontsize=7)
    figure.tight_layout()
    figure.savefig(out / "prediction_error.png", dpi=100)
    plt.close(figure)
