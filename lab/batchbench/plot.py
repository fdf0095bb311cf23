"""batch.png: interactive TTFT over time without and with the batch, and the batch's
lines/s by region against the spare capacity. matplotlib (Agg), imported only here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lab.bench.stats import percentile

BIN_S = 5.0
_REGION_COLORS = ["#2ca02c", "#1f77b4", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2"]


def _p99_bins(points: list[list[Any]], start_s: float, end_s: float
              ) -> tuple[list[float], list[float]]:
    bins: dict[int, list[float]] = {}
    for t, ttft, *_ in points:
        if ttft is not None and start_s <= t < end_s:
            bins.setdefault(int((t - start_s) // BIN_S), []).append(ttft)
    times = [start_s + (index + 0.5) * BIN_S for index in sorted(bins)]
    values = [percentile(bins[index], 99) or 0.0 for index in sorted(bins)]
    return times, values


def batch_png(results: dict[str, Any], series: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (ttft_ax, rate_ax) = plt.subplots(2, 1, figsize=(11, 8), sharex=True)
    figure.suptitle(f"globalpool bench-batch: {results['batch']['lines']} batch lines beside "
                    f"{results['interactive']['rate_per_s']:.1f} req/s of interactive chat",
                    fontsize=10)
    warmup = float(results["options"]["warmup_s"])
    for name, color, label in (("baseline", "#1f77b4", "without the batch"),
                               ("with_batch", "#d62728", "with the batch")):
        phase = series[name]
        window = phase["ran_window_s"] or [warmup, phase["duration_s"]]
        start, end = (warmup, phase["duration_s"]) if name == "baseline" else window
        points = [p for p in phase["interactive"] if p[1] is not None and start <= p[0] < end]
        ttft_ax.scatter([p[0] for p in points], [p[1] for p in points], s=3, alpha=0.35,
                        color=color, linewidths=0)
        times, p99s = _p99_bins(phase["interactive"], start, end)
        p99 = results[name]["ttft_ms"]["p99"]
        ttft_ax.plot(times, p99s, color=color, linewidth=1.5,
                     label=f"{label}: p99 per {BIN_S:g} s (whole phase {p99} ms)")
    base_p99 = results["baseline"]["ttft_ms"]["p99"]
    if base_p99:
        ttft_ax.axhline(1.1 * base_p99, color="#555555", linestyle="--", linewidth=1,
                        label="1.1 x p99 without the batch (the goal)")
    ttft_ax.set_yscale("log")
    ttft_ax.set_ylabel("interactive TTFT (ms, client)")
    ttft_ax.set_title(f"TTFT p99 ratio {results['ttft_ratio']['p99']}x; dots: each request",
                      fontsize=9, loc="right")
    ttft_ax.legend(loc="upper left", fontsize=8)

    _rates(rate_ax, results, series["with_batch"])
    rate_ax.set_xlabel("seconds since the phase started (the batch phase's interactive load "
                       "starts first, then the batch)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _rates_between(looks: list[dict[str, Any]], every_s: float) -> list[dict[str, Any]]:
    """Batch lines/s per region between looks at least `every_s` apart (a line holds its
    slot for about a second: per-second rates are mostly noise in a long run)."""
    kept = [look for look in looks if look["ok_by_region"] is not None]
    rows: list[dict[str, Any]] = []
    previous = kept[0] if kept else None
    for look in kept[1:]:
        assert previous is not None
        span = look["t_s"] - previous["t_s"]
        if span < every_s and look is not kept[-1]:
            continue
        if span > 0:
            rows.append({"t0_s": previous["t_s"], "t1_s": look["t_s"], "lines_per_s": {
                region: (count - previous["ok_by_region"].get(region, 0.0)) / span
                for region, count in look["ok_by_region"].items()}})
        previous = look
    return rows


def _rates(ax: Any, results: dict[str, Any], phase: dict[str, Any]) -> None:
    every_s = BIN_S if phase["duration_s"] > 60 else 1.0
    rows = _rates_between(phase["looks"], every_s)
    prices = {r["region"]: r["cost_per_gpu_hour"] for r in results["batch"]["price_order"]
              ["regions"]}
    regions = list(prices)  # cheapest first
    bottoms = [0.0] * len(rows)
    for index, region in enumerate(regions):
        heights = [row["lines_per_s"].get(region, 0.0) for row in rows]
        ax.bar([row["t0_s"] for row in rows], heights, bottom=bottoms, align="edge",
               width=[row["t1_s"] - row["t0_s"] for row in rows], linewidth=0, alpha=0.85,
               color=_REGION_COLORS[index % len(_REGION_COLORS)],
               label=f"{region} (${prices[region]:g}/GPU h)")
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    spare = results["spare_capacity"]
    ax.axhline(spare["model_lines_per_s"], color="black", linestyle="--", linewidth=1.2,
               label=f"spare capacity, model ({spare['model_lines_per_s']} lines/s)")
    if spare["calibrated_lines_per_s"] is not None:
        ax.axhline(spare["calibrated_lines_per_s"], color="#7f7f7f", linestyle=":",
                   linewidth=1.2, label=f"spare capacity, calibrated "
                   f"({spare['calibrated_lines_per_s']} lines/s)")
    steady = results["batch"]["throughput"]
    if steady["steady_window_s"]:
        ax.axvspan(*steady["steady_window_s"], color="#bbbbbb", alpha=0.15,
                   label=f"steady window ({steady['steady_lines_per_s']} lines/s)")
    ax.set_ylabel(f"batch lines answered / s\n(per {every_s:g} s)")
    ax.set_title(f"throughput / spare (model): {spare['fraction_of_model']}", fontsize=9,
                 loc="right")
    ax.legend(loc="upper right", fontsize=8, ncol=2, framealpha=0.9)
