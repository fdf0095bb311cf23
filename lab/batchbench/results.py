"""results.json: the run's numbers, how each was derived, and the issue's goals."""

from __future__ import annotations

import os
import time
from typing import Any

from lab.batchbench import analysis
from lab.batchbench.analysis import Fleet
from lab.batchbench.capacity import open_by_worker
from lab.batchbench.options import BatchBenchOptions
from lab.batchbench.phase import PhaseRecord

# "Slow" in the diagnosis: this many times the baseline's TTFT p99. Twice is above what a
# longer decode step adds (a few ms a step) and below a wait for a slot (a line's time).
SLOW_P99_TIMES = 2.0

DEFINITIONS = {
    "ttft": "client-side, from sending the request to its first content chunk (SSE), of "
            "streaming chat requests that succeeded; baseline: those started after the "
            "warm-up; with_batch: those started while the batch ran",
    "spare_capacity_model": "sum over workers of spare_slots / line_s: spare_slots = "
                            "int(0.75 x max_num_seqs) - the interactive requests open there "
                            "on average while the batch ran (client records, Little's law); "
                            "line_s = prompt_tokens / prefill_tokens_per_s + "
                            "completion_tokens x (decode_step_ms + decode_step_ms_per_seq x "
                            "sequences) / 1000 with every batch slot full; tokens as the "
                            "batch's answers counted them; engine numbers from regions.yaml "
                            "`simulated` (lab.batchbench.capacity)",
    "spare_capacity_calibrated": "the calibration batch's steady lines/s on the idle fleet "
                                 "x the share of batch slots interactive traffic left free "
                                 "in the batch phase: what this machine's stack delivered "
                                 "per free slot with nothing else running",
    "throughput": "steady: lines done between 5 % and 95 % of the batch over that time; "
                  "ran: all lines over the time from the first look in_progress to the "
                  "first with every line done (1 s looks)",
    "batch_seqs_seen": "a worker's heartbeat running + waiting averaged over the looks "
                       "while the batch ran, less its interactive requests: the batch "
                       "slots the router kept busy",
}


def build_results(options: BatchBenchOptions, fleet: Fleet, calibration: PhaseRecord | None,
                  baseline: PhaseRecord, with_batch: PhaseRecord, *, exited: list[str],
                  load_average_at_start: float) -> dict[str, Any]:
    base_window = (options.warmup_s, options.warmup_s + options.baseline_s)  # load starts
    batch_window = analysis.ran_window(with_batch) or (options.warmup_s, with_batch.duration_s)
    base = analysis.ttft(baseline.interactive, *base_window)
    beside = analysis.ttft(with_batch.interactive, *batch_window)
    batch = _batch(options, fleet, with_batch, *batch_window)
    lag = max(baseline.max_start_lag_s, with_batch.max_start_lag_s)
    results: dict[str, Any] = {
        "bench": "batch", "command": options.command,
        "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "options": options.to_json(),
        "fleet": _fleet(fleet),
        "interactive": _interactive(options, fleet, baseline, base_window),
        "baseline": base, "with_batch": beside,
        "ttft_ratio": {q: _ratio(beside["ttft_ms"][q], base["ttft_ms"][q])
                       for q in ("p50", "p90", "p99")},
        "batch": batch, "calibration": _calibration(options, fleet, calibration),
        "diagnosis": _diagnosis(fleet, (baseline, base_window), (with_batch, batch_window),
                                slow_ms=_times(SLOW_P99_TIMES, base["ttft_ms"]["p99"])),
        "load": {"skipped": baseline.skipped + with_batch.skipped,
                 "max_start_lag_s": round(lag, 3), "machine_stalled": lag > analysis.STALL_S},
        "host": {"cpus": os.cpu_count(), "load_average_1m_at_start": load_average_at_start,
                 "load_average_1m_at_end": os.getloadavg()[0]},
        "exited_children": exited,
        "definitions": DEFINITIONS,
    }
    results["spare_capacity"] = _spare(batch.pop("spare"), results["calibration"],
                                       batch["throughput"]["steady_lines_per_s"])
    results["goals"] = goals(results)
    results["goals_met"] = all(goal["met"] for goal in results["goals"])
    return results


def _interactive(options: BatchBenchOptions, fleet: Fleet, baseline: PhaseRecord,
                 window: tuple[float, float]) -> dict[str, Any]:
    """The interactive load, and the share of the fleet's slots it held in the baseline
    (client records; the heartbeats' running + waiting)."""
    slots = sum(fleet.speed(w).max_num_seqs for w in fleet.workers)
    held = sum(open_by_worker(baseline.interactive, *window).values())
    heartbeat = sum(analysis.mean_load(baseline.samples, *window).values())
    return {
        "rate_per_s": baseline.rate_per_s, "max_tokens": options.interactive_max_tokens,
        "origins": sorted({r.origin_region or "-" for r in baseline.interactive}),
        "sized_share_of_slots": options.interactive_share,
        "share_of_slots_held": round(held / slots, 3) if slots else None,
        "share_of_slots_held_heartbeats": round(heartbeat / slots, 3) if slots else None,
    }


def _spare(spare: dict[str, Any], calibration: dict[str, Any] | None,
           steady: float | None) -> dict[str, Any]:
    """The model's spare capacity, the calibrated one, and the batch's share of each."""
    free = spare["spare_slots"] / spare["batch_slots"] if spare["batch_slots"] else 0.0
    idle = None if calibration is None else calibration["steady_lines_per_s"]
    calibrated = None if idle is None else round(idle * free, 2)
    return {**spare, "calibrated_lines_per_s": calibrated,
            "fraction_of_model": _ratio(steady, spare["model_lines_per_s"]),
            "fraction_of_calibrated": _ratio(steady, calibrated)}


def _batch(options: BatchBenchOptions, fleet: Fleet, record: PhaseRecord, start_s: float,
           end_s: float) -> dict[str, Any]:
    outcome = record.batch
    assert outcome is not None
    served = analysis.served_by_region(record.samples)
    prompt, completion = analysis.tokens(record, options.batch_max_tokens)
    interactive = open_by_worker(record.interactive, start_s, end_s)
    seen = analysis.mean_load(record.samples, start_s, end_s)
    workers = analysis.spare_capacity(fleet, interactive, prompt, completion)
    rows = [{"worker": w.worker, "region": w.region, "batch_slots": w.batch_slots,
             "interactive_seqs": round(w.interactive_seqs, 2),
             "spare_slots": round(w.spare_slots, 2), "line_s": round(w.line_s, 3),
             "spare_lines_per_s": round(w.lines_per_s, 2),
             "batch_seqs_seen": None if w.worker not in seen
             else round(seen[w.worker] - w.interactive_seqs, 2)} for w in workers]
    by_region: dict[str, float] = {}
    for w in workers:
        by_region[w.region] = by_region.get(w.region, 0.0) + w.lines_per_s
    ran_s = end_s - start_s
    order = analysis.price_order(fleet, served)
    for row in order["regions"]:
        model = by_region.get(row["region"], 0.0)
        row["lines_per_s"] = round(row["lines"] / ran_s, 2) if ran_s > 0 else None
        row["spare_model_lines_per_s"] = round(model, 2)
        row["used_of_spare"] = _ratio(row["lines_per_s"], model)
    return {
        "id": outcome.id, "status": outcome.status, "lines": options.lines,
        "request_counts": outcome.request_counts,
        "every_line_completed": (outcome.status == "completed"
                                 and outcome.answered_ok == options.lines
                                 and outcome.missing_custom_ids == 0
                                 and outcome.distinct_custom_ids == options.lines),
        "answered_ok": outcome.answered_ok, "error_lines": outcome.error_lines,
        "missing_custom_ids": outcome.missing_custom_ids, "timed_out": outcome.timed_out,
        "tokens": {"prompt_mean": prompt, "completion_mean": completion},
        "created_to_ended_s": round(outcome.ended_s - outcome.created_s, 2),
        "throughput": analysis.throughput(record),
        "price_order": order,
        "spare": {"model_lines_per_s": round(sum(w.lines_per_s for w in workers), 2),
                  "batch_slots": sum(w.batch_slots for w in workers),
                  "spare_slots": round(sum(w.spare_slots for w in workers), 2),
                  "workers": rows},
    }


def _diagnosis(fleet: Fleet, *phases: tuple[PhaseRecord, tuple[float, float]],
               slow_ms: float | None) -> dict[str, Any]:
    """Why interactive TTFT moved: how full the engines were (heartbeats), the decode step
    the simulator makes of that load, how often a worker had no free slot, and how many
    of the requests slower than `slow_ms` started on such a worker."""
    found: dict[str, Any] = {"mean_sequences_per_worker": {}, "decode_step_ms_model": {},
                             "full_worker_looks": {}, "slow_requests": {}}
    for record, (start_s, end_s) in phases:
        name = record.name
        load = analysis.mean_load(record.samples, start_s, end_s)
        mean = sum(load.values()) / len(load) if load else None
        steps = [fleet.speed(w).step_ms(seqs) for w, seqs in load.items() if w in fleet.workers]
        found["mean_sequences_per_worker"][name] = None if mean is None else round(mean, 2)
        found["decode_step_ms_model"][name] = (round(sum(steps) / len(steps), 2)
                                               if steps else None)
        found["full_worker_looks"][name] = analysis.full_share(fleet, record.samples, start_s,
                                                               end_s)
        found["slow_requests"][name] = analysis.slow_on_full(
            fleet, record.interactive, record.samples, (start_s, end_s), slow_ms)
    return found


def _calibration(options: BatchBenchOptions, fleet: Fleet, record: PhaseRecord | None
                 ) -> dict[str, Any] | None:
    if record is None or record.batch is None:
        return None
    prompt, completion = analysis.tokens(record, options.batch_max_tokens)
    idle = analysis.spare_capacity(fleet, {}, prompt, completion)
    model = sum(w.lines_per_s for w in idle)
    measured = analysis.throughput(record)
    return {"lines": options.calibration_lines, "status": record.batch.status,
            **measured, "model_lines_per_s": round(model, 2),
            "efficiency": _ratio(measured["steady_lines_per_s"], model)}


def _fleet(fleet: Fleet) -> dict[str, Any]:
    regions = {}
    for name, spec in fleet.config.regions.items():
        pool = spec.simulated
        regions[name] = {"cost_per_gpu_hour": spec.cost_per_gpu_hour, "workers": pool.workers,
                         "max_num_seqs": pool.max_num_seqs,
                         "decode_step_ms": pool.decode_step_ms,
                         "decode_step_ms_per_seq": pool.decode_step_ms_per_seq,
                         "prefill_tokens_per_s": pool.prefill_tokens_per_s}
    return {"router_region": fleet.config.router.region, "regions": regions,
            "workers": dict(sorted(fleet.workers.items()))}


def goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 24's three goals, and the check that every line was answered."""
    ratio = results["ttft_ratio"]["p99"]
    fraction = results["spare_capacity"]["fraction_of_model"]
    order = results["batch"]["price_order"]
    shares = ", ".join(f"{r['region']} ({r['cost_per_gpu_hour']:g}) {100 * r['share']:.1f}%"
                       for r in order["regions"])
    return [
        {"goal": f"interactive TTFT p99 with the batch <= {analysis.TTFT_RATIO_GOAL}x without",
         "measured": f"{ratio}x ({results['with_batch']['ttft_ms']['p99']} ms vs "
                     f"{results['baseline']['ttft_ms']['p99']} ms)",
         "met": ratio is not None and ratio <= analysis.TTFT_RATIO_GOAL},
        {"goal": f"batch throughput >= {analysis.THROUGHPUT_GOAL:.0%} of the fleet's spare "
                 "capacity (model)",
         "measured": f"{fraction} ({results['batch']['throughput']['steady_lines_per_s']} "
                     f"of {results['spare_capacity']['model_lines_per_s']} lines/s)",
         "met": fraction is not None and fraction >= analysis.THROUGHPUT_GOAL},
        {"goal": "lines served per region follow the price order (cheapest most)",
         "measured": shares, "met": bool(order["followed"])},
        {"goal": "every line answered once (200), none missing",
         "measured": f"{results['batch']['answered_ok']} of {results['batch']['lines']} ok, "
                     f"{results['batch']['missing_custom_ids']} missing",
         "met": bool(results["batch"]["every_line_completed"])},
    ]


def _times(factor: float, value: float | None) -> float | None:
    return None if value is None else round(factor * value, 1)


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return round(numerator / denominator, 3)
