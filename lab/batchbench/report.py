"""What a run leaves in --out: results.json (the numbers), timeline.json (every request's
TTFT and every look, which the PNG is drawn from), batch.png and summary.md.

    python -m lab.batchbench.report DIR   # redraw batch.png and summary.md, print the table
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from lab.batchbench import analysis
from lab.batchbench.phase import PhaseRecord


def timeline(records: list[PhaseRecord]) -> dict[str, Any]:
    """Per phase: each interactive request (start, TTFT ms or null, worker) and each look."""
    return {record.name: {
        "duration_s": record.duration_s,
        "ran_window_s": (list(window) if (window := analysis.ran_window(record)) else None),
        "interactive": [[round(r.start_s, 2), None if (t := r.ttft_ms) is None or not r.ok
                         else round(t, 1), r.worker]
                        for r in sorted(record.interactive, key=lambda r: r.start_s)],
        "looks": [sample.to_json() for sample in record.samples],
    } for record in records}


def write_outputs(out: Path, results: dict[str, Any], records: list[PhaseRecord]) -> None:
    from lab.batchbench.plot import batch_png

    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    series = timeline(records)
    (out / "timeline.json").write_text(json.dumps(series, separators=(",", ":")) + "\n")
    batch_png(results, series, out / "batch.png")
    (out / "summary.md").write_text(markdown(results))


def _n(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}{unit}" if abs(value) < 100 else f"{value:.0f}{unit}"
    return f"{value}{unit}"


def summary_table(results: dict[str, Any]) -> str:
    """The run in a few lines of text (printed at the end)."""
    base, beside, ratio = results["baseline"], results["with_batch"], results["ttft_ratio"]
    batch, spare = results["batch"], results["spare_capacity"]
    calibration = results["calibration"] or {}
    lines = [
        f"{'':<26}{'p50':>10}{'p90':>10}{'p99':>10}{'requests':>10}{'failed':>8}",
        *(f"{label:<26}" + "".join(f"{_n(phase['ttft_ms'][q], ' ms'):>10}"
                                   for q in ("p50", "p90", "p99"))
          + f"{phase['requests']:>10}{phase['failed']:>8}"
          for label, phase in (("TTFT without the batch", base), ("TTFT with the batch", beside))),
        f"{'ratio':<26}" + "".join(f"{_n(ratio[q], 'x'):>10}" for q in ("p50", "p90", "p99")),
        "",
        f"batch: {batch['lines']} lines, {batch['status']}, "
        f"{batch['answered_ok']} answered 200, {batch['missing_custom_ids']} missing; "
        f"ran {_n(_span(batch['throughput']['ran_window_s']), ' s')}",
        f"throughput: steady {_n(batch['throughput']['steady_lines_per_s'])} lines/s "
        f"(whole run {_n(batch['throughput']['ran_lines_per_s'])}); spare capacity: model "
        f"{_n(spare['model_lines_per_s'])} lines/s ({_n(spare['spare_slots'])} of "
        f"{spare['batch_slots']} batch slots free), calibrated "
        f"{_n(spare['calibrated_lines_per_s'])} -> {_n(spare['fraction_of_model'])} of model, "
        f"{_n(spare['fraction_of_calibrated'])} of calibrated",
        f"idle fleet (calibration, {calibration.get('lines', 0)} lines): "
        f"{_n(calibration.get('steady_lines_per_s'))} lines/s vs model "
        f"{_n(calibration.get('model_lines_per_s'))} ({_n(calibration.get('efficiency'))})",
        "by region (cheapest first): " + ", ".join(
            f"{r['region']} ${r['cost_per_gpu_hour']:g}: {r['lines']} lines "
            f"({100 * r['share']:.1f}%, {_n(r['used_of_spare'])} of its spare)"
            for r in batch["price_order"]["regions"]),
        "",
        *(f"goal {'met   ' if g['met'] else 'MISSED'} {g['goal']} ({g['measured']})"
          for g in results["goals"]),
    ]
    lines += ["", diagnosis(results)]
    if results["load"]["machine_stalled"]:
        lines.append(f"warning: the load generator started a request "
                     f"{results['load']['max_start_lag_s']} s late: the machine stalled")
    return "\n".join(lines)


def _span(window: list[float] | None) -> float | None:
    return None if window is None else round(window[1] - window[0], 1)


def markdown(results: dict[str, Any]) -> str:
    """summary.md: the tables of a run, for BENCHMARKS.md."""
    base, beside, ratio = results["baseline"], results["with_batch"], results["ttft_ratio"]
    batch, spare = results["batch"], results["spare_capacity"]
    interactive = results["interactive"]
    lines = [
        f"`{results['command'] or 'globalpool bench-batch'}` ({results['finished_utc']}, "
        f"{results['host']['cpus']} CPUs, load average "
        f"{results['host']['load_average_1m_at_start']:.2f} at the start)",
        "",
        f"Interactive: {_n(interactive['rate_per_s'])} req/s of streaming chat, "
        f"{interactive['max_tokens']} tokens, from clients in {', '.join(interactive['origins'])}; "
        f"it held {_n(interactive['share_of_slots_held'])} of the fleet's slots in the "
        f"baseline. Batch: {batch['lines']} lines of {_n(batch['tokens']['completion_mean'])} "
        "tokens.",
        "",
        "| interactive TTFT (client) | p50 | p90 | p99 | requests | failed |",
        "|---|---|---|---|---|---|",
        *(f"| {label} | " + " | ".join(_n(phase["ttft_ms"][q], " ms")
                                      for q in ("p50", "p90", "p99"))
          + f" | {phase['requests']} | {phase['failed']} |"
          for label, phase in (("without the batch", base), ("with the batch", beside))),
        "| ratio | " + " | ".join(_n(ratio[q], "x") for q in ("p50", "p90", "p99")) + " | | |",
        "",
        "| batch | |", "|---|---|",
        f"| lines answered 200 / missing | {batch['answered_ok']} / "
        f"{batch['missing_custom_ids']} |",
        f"| ran for | {_n(_span(batch['throughput']['ran_window_s']), ' s')} |",
        f"| throughput, steady (5-95 %) / whole run | "
        f"{_n(batch['throughput']['steady_lines_per_s'])} / "
        f"{_n(batch['throughput']['ran_lines_per_s'])} lines/s |",
        f"| spare capacity, model | {_n(spare['model_lines_per_s'])} lines/s "
        f"({_n(spare['spare_slots'])} of {spare['batch_slots']} batch slots free) |",
        f"| spare capacity, calibrated | {_n(spare['calibrated_lines_per_s'])} lines/s |",
        f"| throughput / spare (model, calibrated) | {_n(spare['fraction_of_model'])}, "
        f"{_n(spare['fraction_of_calibrated'])} |",
        "",
        "| region | $/GPU h | lines | share | lines/s | spare (model) | used of spare |",
        "|---|---|---|---|---|---|---|",
        *(f"| {r['region']} | {r['cost_per_gpu_hour']:g} | {r['lines']} | "
          f"{100 * r['share']:.1f} % | {_n(r['lines_per_s'])} | "
          f"{_n(r['spare_model_lines_per_s'])} | {_n(r['used_of_spare'])} |"
          for r in batch["price_order"]["regions"]),
        "",
        *(f"- {'met' if g['met'] else '**missed**'}: {g['goal']} ({g['measured']})"
          for g in results["goals"]),
        "",
        diagnosis(results),
    ]
    return "\n".join(lines) + "\n"


def diagnosis(results: dict[str, Any]) -> str:
    """One paragraph: how full the engines were without and with the batch."""
    found = results["diagnosis"]
    seqs, step = found["mean_sequences_per_worker"], found["decode_step_ms_model"]
    full, slow = found["full_worker_looks"], found["slow_requests"]["with_batch"]
    return (f"Engines: {_n(seqs['baseline'])} sequences per worker on average without the "
            f"batch, {_n(seqs['with_batch'])} with it (the simulator's decode step "
            f"{_n(step['baseline'], ' ms')} -> {_n(step['with_batch'], ' ms')}); a worker "
            f"had no free slot (max_num_seqs running, or some waiting) in "
            f"{_percent(full['baseline'])} of the looks without the batch, "
            f"{_percent(full['with_batch'])} with it. With the batch, {slow['requests']} "
            f"interactive requests took longer than twice the baseline's p99 "
            f"({_n(slow['above_ms'], ' ms')}); {slow['on_a_full_worker']} of them went to a "
            "worker seen full in the look before or after they started.")


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.1f} %"


def main(argv: list[str] | None = None) -> int:
    """Redraw DIR's batch.png and summary.md from its results.json and timeline.json."""
    arguments = sys.argv[1:] if argv is None else argv
    if len(arguments) != 1:
        print("usage: python -m lab.batchbench.report DIR", file=sys.stderr)
        return 2
    from lab.batchbench.plot import batch_png

    out = Path(arguments[0])
    results = json.loads((out / "results.json").read_text())
    batch_png(results, json.loads((out / "timeline.json").read_text()), out / "batch.png")
    (out / "summary.md").write_text(markdown(results))
    print(summary_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
