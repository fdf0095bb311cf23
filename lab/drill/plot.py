"""timeline.png: traffic share per region, errors, and TTFT P99, per second, fault marked.

matplotlib with the Agg backend (no display); imported only when a report is written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2"]


def timeline_start(report: dict[str, Any]) -> float:
    """End of the warm-up (shaded grey: not counted in any phase)."""
    return float(report["timeline"]["warmup_end_s"])


def timeline_png(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows: list[dict[str, Any]] = report["per_second"]
    seconds = [row["second"] + 0.5 for row in rows]
    seen = {region for row in rows for region in row["served_by_region"]}
    # The config's order, so that a region has the same colour in every drill's plot.
    regions = [r for r in report.get("regions", []) if r in seen] + sorted(
        seen - set(report.get("regions", [])))
    figure, (share_ax, error_ax, ttft_ax) = plt.subplots(
        3, 1, figsize=(11, 8), sharex=True, gridspec_kw={"height_ratios": [3, 2, 2]})
    figure.suptitle(f"globalpool drill {report['scenario']}: {report['description']}",
                    fontsize=10)

    bottoms = [0.0] * len(rows)
    for index, region in enumerate(regions):
        shares = [100.0 * row["served_by_region"].get(region, 0) / row["requests"]
                  if row["requests"] else 0.0 for row in rows]
        share_ax.bar(seconds, shares, width=1.0, bottom=bottoms, label=region,
                     color=_COLORS[index % len(_COLORS)], linewidth=0)
        bottoms = [b + s for b, s in zip(bottoms, shares, strict=True)]
    failed = [100.0 * (row["failed_before_first_byte"] + row["failed_mid_stream"])
              / row["requests"] if row["requests"] else 0.0 for row in rows]
    share_ax.bar(seconds, failed, width=1.0, bottom=bottoms, label="failed", color="#d62728",
                 linewidth=0)
    if report.get("target_workers"):
        share_ax.plot(seconds, [100.0 * row.get("served_by_target", 0) / row["requests"]
                                if row["requests"] else 0.0 for row in rows],
                      color="black", linewidth=1.2, drawstyle="steps-mid",
                      label=f"served by {', '.join(report['target_workers'])}")
    share_ax.set_ylabel("served by region\n(% of requests started)")
    share_ax.set_ylim(0, 105)
    share_ax.legend(loc="lower left", fontsize=8, ncol=len(regions) + 1)
    share_ax.axvspan(0, timeline_start(report), color="#bbbbbb", alpha=0.2)

    error_ax.bar(seconds, [row["failed_before_first_byte"] for row in rows], width=1.0,
                 color="#d62728", label="failed before first byte")
    error_ax.bar(seconds, [row["failed_mid_stream"] for row in rows], width=1.0,
                 bottom=[row["failed_before_first_byte"] for row in rows], color="#ff9896",
                 label="failed mid-stream")
    error_ax.plot(seconds, [row["retried"] for row in rows], color="#7f7f7f", linewidth=1,
                  label="retried (succeeded or not)")
    error_ax.set_ylabel("requests / s")
    error_ax.legend(loc="upper left", fontsize=8)

    ttft = [row["ttft_p99_ms"] for row in rows]
    ttft_ax.plot([s for s, v in zip(seconds, ttft, strict=True) if v is not None],
                 [v for v in ttft if v is not None], marker=".", color="#17becf")
    ttft_ax.set_ylabel("TTFT P99 (ms)")
    ttft_ax.set_yscale("log")
    ttft_ax.set_xlabel("seconds since the load started")

    timeline = report["timeline"]
    for ax in (share_ax, error_ax, ttft_ax):
        ax.axvspan(timeline["fault_s"], timeline["cleared_s"], color="#d62728", alpha=0.08)
        ax.axvline(timeline["fault_s"], color="#d62728", linewidth=1.2)
        ax.axvline(timeline["cleared_s"], color="#2ca02c", linewidth=1.2, linestyle="--")
        for event in report["events"][1:-1]:
            ax.axvline(event["t_s"], color="#444444", linewidth=0.5, linestyle=":")
    share_ax.annotate("fault", (timeline["fault_s"], 102), fontsize=8, color="#d62728")
    share_ax.annotate("cleared", (timeline["cleared_s"], 102), fontsize=8, color="#2ca02c")
    detect, reroute = report.get("time_to_detect_s"), report.get("time_to_reroute_s")
    notes = [f"detect {detect:.2f} s" if detect is not None else "detect -",
             f"reroute {reroute:.2f} s" if reroute is not None else "reroute -",
             f"failed {report['failed']['before_first_byte']} before first byte, "
             f"{report['failed']['mid_stream']} mid-stream"]
    error_ax.set_title("; ".join(notes), fontsize=9, loc="right")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
