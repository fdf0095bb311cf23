"""The numbers of a run, from its phases' records: TTFT with and without the batch, the
batch's throughput against the spare capacity the fleet left it, where its lines ran.

Windows (seconds since each phase started; 1 s resolution, the probe's):
- a batch **ran** from the first look that saw it `in_progress` to the first that saw
  every line done (before its files are written);
- its **steady** throughput is between the moments 5 % and 95 % of its lines were done
  (interpolated between looks): no ramp-up (validation, first claims), no tail (the last
  lines finishing while slots empty);
- the baseline's interactive requests count from the end of its warm-up; the batch
  phase's, those started while the batch ran.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lab.batchbench.capacity import EngineSpeed, WorkerSpare, open_by_worker, worker_spare
from lab.batchbench.phase import PhaseRecord
from lab.batchbench.probe import Sample
from lab.batchbench.workload import PROMPT_TOKENS_GUESS
from lab.bench.stats import percentile
from lab.devstack.loadgen import RequestResult
from router.config import GlobalConfig

TTFT_RATIO_GOAL = 1.1
THROUGHPUT_GOAL = 0.8
STEADY = (0.05, 0.95)
STALL_S = 0.25  # an open-loop start this late means the machine, not the router, stalled


@dataclass(frozen=True)
class Fleet:
    """The workers the stack started (id -> region) and the config they run."""

    config: GlobalConfig
    workers: Mapping[str, str]

    def speed(self, worker: str) -> EngineSpeed:
        return EngineSpeed.of(self.config.regions[self.workers[worker]].simulated)

    def price(self, region: str) -> float:
        return self.config.cost_per_gpu_hour(region)


def crossing_s(samples: Sequence[Sample], count: float) -> float | None:
    """When the batch's done lines reached `count`, interpolated between two looks."""
    previous: tuple[float, int] | None = None
    for sample in samples:
        done = sample.done
        if done is None:
            continue
        if done >= count:
            if previous is None or done == previous[1]:
                return sample.t_s
            t0, d0 = previous
            return t0 + (count - d0) / (done - d0) * (sample.t_s - t0)
        previous = (sample.t_s, done)
    return None


def ran_window(record: PhaseRecord) -> tuple[float, float] | None:
    """(first look in_progress or later, first look with every line done); None if the
    batch never got that far. A batch that ran wholly between two looks (a small one: the
    probe looks every second) is given the window from the look before: at most one
    look's interval too long, so its throughput is a lower bound, not missing."""
    total = record.batch.request_counts.get("total") if record.batch else None
    samples = record.samples
    first = next((index for index, s in enumerate(samples) if s.status is not None
                  and s.status not in ("validating", "failed")), None)
    end = next((s.t_s for s in samples if total and s.done is not None
                and s.done >= total), None)
    if first is None or end is None:
        return None
    start = samples[first].t_s
    if end <= start and first > 0:
        start = samples[first - 1].t_s
    if end <= start:
        return None
    return start, end


def throughput(record: PhaseRecord) -> dict[str, Any]:
    """Lines/s: steady (5 %..95 % done) and over the whole run window."""
    total = record.batch.request_counts.get("total", 0) if record.batch else 0
    window = ran_window(record)
    low, high = (crossing_s(record.samples, share * total) for share in STEADY)
    steady = None
    if low is not None and high is not None and high > low:
        steady = (STEADY[1] - STEADY[0]) * total / (high - low)
    overall = total / (window[1] - window[0]) if window else None
    return {"steady_lines_per_s": _round(steady, 2), "steady_window_s": _pair(low, high),
            "ran_lines_per_s": _round(overall, 2),
            "ran_window_s": None if window is None else list(window)}


def ttft(results: Sequence[RequestResult], start_s: float, end_s: float) -> dict[str, Any]:
    """Client-side TTFT (first content chunk) of the requests started in the window."""
    started = [r for r in results if start_s <= r.start_s < end_s]
    values = [t for r in started if r.ok and (t := r.ttft_ms) is not None]
    return {
        "window_s": [round(start_s, 2), round(end_s, 2)],
        "requests": len(started), "failed": sum(not r.ok for r in started),
        "rate_per_s": _round(len(started) / (end_s - start_s) if end_s > start_s else None, 2),
        "ttft_ms": {f"p{q}": _round(percentile(values, q), 1) for q in (50, 90, 99)},
        "ttft_mean_ms": _round(sum(values) / len(values) if values else None, 1),
    }


def served_by_region(samples: Sequence[Sample]) -> dict[str, float]:
    """Batch lines answered 200 per region during the phase (last look less first)."""
    looks = [s.ok_by_region for s in samples if s.ok_by_region is not None]
    if not looks:
        return {}
    first, last = looks[0], looks[-1]
    return {region: last[region] - first.get(region, 0.0) for region in sorted(last)
            if last[region] - first.get(region, 0.0) > 0}


def mean_load(samples: Sequence[Sample], start_s: float, end_s: float) -> dict[str, float]:
    """Each worker's heartbeat running + waiting, averaged over the looks in the window."""
    totals: dict[str, list[int]] = {}
    for sample in samples:
        if not start_s <= sample.t_s <= end_s or sample.running_by_worker is None:
            continue
        waiting = sample.waiting_by_worker or {}
        for worker, running in sample.running_by_worker.items():
            totals.setdefault(worker, []).append(running + waiting.get(worker, 0))
    return {worker: sum(values) / len(values) for worker, values in totals.items()}


def full_share(fleet: Fleet, samples: Sequence[Sample], start_s: float, end_s: float
               ) -> float | None:
    """Of the (look, worker) pairs in the window, the share where the worker ran
    `max_num_seqs` sequences or had some waiting: a new interactive request there waits
    for a slot (a whole answer's time) instead of starting at the next step."""
    seen = [_full(fleet, sample, worker) for sample in samples
            if start_s <= sample.t_s <= end_s and sample.running_by_worker is not None
            for worker in sample.running_by_worker if worker in fleet.workers]
    return round(sum(map(bool, seen)) / len(seen), 4) if seen else None


def _full(fleet: Fleet, sample: Sample, worker: str) -> bool | None:
    if sample.running_by_worker is None or worker not in sample.running_by_worker:
        return None
    waiting = (sample.waiting_by_worker or {}).get(worker, 0)
    return sample.running_by_worker[worker] >= fleet.speed(worker).max_num_seqs or waiting > 0


def slow_on_full(fleet: Fleet, results: Sequence[RequestResult], samples: Sequence[Sample],
                 window: tuple[float, float], slow_ms: float | None) -> dict[str, Any]:
    """Requests started in the window with a TTFT above `slow_ms`, and how many of them
    went to a worker that the look before or after their start saw full (`full_share`;
    a look reads heartbeats up to one interval old, so this is an attribution, not a
    proof)."""
    slow = [r for r in results if window[0] <= r.start_s < window[1] and r.ok
            and r.worker in fleet.workers and (t := r.ttft_ms) is not None
            and slow_ms is not None and t > slow_ms]
    looks = [s for s in samples if s.running_by_worker is not None]
    times = [s.t_s for s in looks]
    on_full = 0
    for result in slow:
        assert result.worker is not None
        after = bisect.bisect_left(times, result.start_s)
        near = looks[max(0, after - 1):after + 1]
        on_full += any(_full(fleet, look, result.worker) for look in near)
    return {"above_ms": slow_ms, "requests": len(slow), "on_a_full_worker": on_full}


def spare_capacity(fleet: Fleet, interactive: Mapping[str, float], prompt_tokens: float,
                   completion_tokens: float) -> list[WorkerSpare]:
    return [worker_spare(worker, region, fleet.speed(worker), interactive.get(worker, 0.0),
                         prompt_tokens, completion_tokens)
            for worker, region in sorted(fleet.workers.items())]


def price_order(fleet: Fleet, served: Mapping[str, float]) -> dict[str, Any]:
    """Shares of the batch's lines per region, cheapest region first; `followed`: no
    region served a larger share than a cheaper one."""
    regions = sorted(fleet.config.regions, key=lambda r: (fleet.price(r), r))
    total = sum(served.values()) or 1.0
    shares = {r: served.get(r, 0.0) / total for r in regions}
    followed = all(shares[cheap] >= shares[dear]
                   for i, cheap in enumerate(regions) for dear in regions[i + 1:]
                   if fleet.price(dear) > fleet.price(cheap))
    rows = [{"region": r, "cost_per_gpu_hour": fleet.price(r), "lines": int(served.get(r, 0)),
             "share": round(shares[r], 4)} for r in regions]
    return {"regions": rows, "followed": followed}


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def _pair(low: float | None, high: float | None) -> list[float] | None:
    return None if low is None or high is None else [round(low, 2), round(high, 2)]


def tokens(record: PhaseRecord, max_tokens: int) -> tuple[float, float]:
    """Mean prompt and completion tokens of the batch's answered lines (as the engine
    counted them); before any answer, a guess and `max_tokens`."""
    batch = record.batch
    prompt = batch.prompt_tokens_mean if batch else None
    completion = batch.completion_tokens_mean if batch else None
    return (prompt if prompt is not None else float(PROMPT_TOKENS_GUESS),
            completion if completion is not None else float(max_tokens))


__all__ = ["STALL_S", "THROUGHPUT_GOAL", "TTFT_RATIO_GOAL", "Fleet", "crossing_s",
           "full_share", "mean_load", "open_by_worker", "price_order", "ran_window",
           "served_by_region", "slow_on_full", "spare_capacity", "throughput", "tokens", "ttft"]
