"""From per-request records to a drill's numbers. Pure functions; times are seconds since
the load started.

Definitions (also written into every report):

- A request *touches* the fault target if it was served by the faulty region or worker,
  or the router retried it (a `retry` phase in `server-timing`: an earlier attempt went
  somewhere and failed), or it failed.
- `time_to_detect_s`: from the fault to the first moment T from which, for `QUIET_S`
  (1 s), no new request touched the target. T is the fault itself or the start of a
  touching request. It is when the router stopped sending new requests to the faulty
  region/worker, as seen from its requests; later isolated touches (half-open probes
  after a backoff, or an oscillation) are counted separately as `touches_after_detect`.
  None if the router never stopped while the fault lasted.
- `time_to_reroute_s`: from the fault to the start of the first 1-s window (starting at
  the fault or at a request's start) in which every new request succeeded elsewhere:
  status 200, complete stream, served outside the target, not retried. None if no such
  window began while the fault lasted.
- `time_to_return_s`: from the fault's end to the first 1-s window in which the target
  serves at least half its pre-fault share of requests again. The load goes on after the
  fault until that is seen (`returned`), then a little longer, within a bound
  (lab.drill.run); None if it was not seen by then, or the target served nothing
  before the fault.
- For a fault without a target (Redis outage) both come from the router's /health:
  detect = fault -> first answer with `redis_connected: false`; recover = Redis back ->
  first answer with `redis_connected: true` and every worker known again.
- Phases by request start: `before` [warmup end, fault), `during` [fault, fault cleared),
  `after` [fault cleared, end). TTFT percentiles count requests that got a first token.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from lab.devstack.loadgen import RequestResult

QUIET_S = 1.0
REROUTE_WINDOW_S = 1.0
# While the load runs, only requests started this long ago are judged: they have ended
# (after the fault nothing holds a request that long), so their windows are complete.
RETURN_LAG_S = 1.0


@dataclass(frozen=True)
class Target:
    """What the fault hits: whole regions and/or single workers (empty: nothing routable)."""

    regions: frozenset[str] = frozenset()
    workers: frozenset[str] = frozenset()

    @property
    def label(self) -> str:
        parts = [f"region {r}" for r in sorted(self.regions)]
        parts += [f"worker {w}" for w in sorted(self.workers)]
        return ", ".join(parts) or "-"

    def __bool__(self) -> bool:
        return bool(self.regions or self.workers)

    def serves(self, result: RequestResult) -> bool:
        return result.region in self.regions or result.worker in self.workers

    def touched_by(self, result: RequestResult) -> bool:
        return self.serves(result) or result.retried or not result.ok


@dataclass(frozen=True)
class Timeline:
    """The drill's schedule, in seconds since the load started."""

    warmup_end_s: float
    fault_s: float
    cleared_s: float
    end_s: float

    def phase(self, start_s: float) -> str | None:
        if start_s < self.warmup_end_s:
            return None
        if start_s < self.fault_s:
            return "before"
        if start_s < self.cleared_s:
            return "during"
        return "after"


def relative(results: Iterable[RequestResult], t0_s: float) -> list[RequestResult]:
    """Copies with every time shifted to seconds since `t0_s`, sorted by start."""
    def shift(value: float | None) -> float | None:
        return None if value is None else value - t0_s
    shifted = [
        replace(r, start_s=r.start_s - t0_s, end_s=r.end_s - t0_s,
                first_byte_s=shift(r.first_byte_s), first_token_s=shift(r.first_token_s))
        for r in results
    ]
    return sorted(shifted, key=lambda r: r.start_s)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of `values`; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


def time_to_detect(requests: Sequence[RequestResult], target: Target,
                   timeline: Timeline) -> tuple[float | None, int]:
    """(seconds from fault to detection or None, touches after detection); see module doc."""
    fault, cleared = timeline.fault_s, timeline.cleared_s
    touches = [r.start_s for r in requests
               if fault <= r.start_s < cleared and target.touched_by(r)]
    candidates = [fault, *touches]
    for index, moment in enumerate(candidates):
        if moment + QUIET_S > cleared:
            break  # too close to the end of the fault to tell
        following = touches[index] if index < len(touches) else math.inf
        if following > moment + QUIET_S:
            return moment - fault, len(touches) - index
    return None, 0


def time_to_reroute(requests: Sequence[RequestResult], target: Target,
                    timeline: Timeline) -> float | None:
    """Seconds from fault to the first clean 1-s window, or None; see module doc."""
    fault, cleared = timeline.fault_s, timeline.cleared_s
    new = [r for r in requests if fault <= r.start_s < cleared]
    starts = [fault, *(r.start_s for r in new)]
    for moment in starts:
        if moment + REROUTE_WINDOW_S > cleared:
            return None
        window = [r for r in new if moment <= r.start_s < moment + REROUTE_WINDOW_S]
        if window and all(r.ok and not r.retried and not target.serves(r) for r in window):
            return moment - fault
    return None


def time_to_return(requests: Sequence[RequestResult], target: Target,
                   timeline: Timeline) -> float | None:
    """Seconds from the fault's end to the start of the first 1-s window in which the
    target serves at least half the share of requests it served before the fault; None if
    that did not happen before the end (or the target served nothing before)."""
    share_before = share_before_fault(requests, target, timeline)
    if share_before == 0:
        return None
    after = [r for r in requests if r.start_s >= timeline.cleared_s]
    for moment in [timeline.cleared_s, *(r.start_s for r in after)]:
        if moment + REROUTE_WINDOW_S > timeline.end_s:
            return None
        window = [r for r in after if moment <= r.start_s < moment + REROUTE_WINDOW_S]
        if window and sum(1 for r in window if target.serves(r)) / len(window) >= (
                share_before / 2):
            return moment - timeline.cleared_s
    return None


def share_before_fault(requests: Sequence[RequestResult], target: Target,
                       timeline: Timeline) -> float:
    """The share of the `before` phase's requests that the target served (0 if none)."""
    before = [r for r in requests if timeline.phase(r.start_s) == "before"]
    if not before:
        return 0.0
    return sum(1 for r in before if target.serves(r)) / len(before)


def returned(requests: Sequence[RequestResult], target: Target, timeline: Timeline,
             now_s: float) -> bool:
    """Whether the return can be told by `now_s`, while the load still runs (`requests`:
    those that have ended): `time_to_return` finds it among the requests started before
    `now_s - RETURN_LAG_S`, or there is no share to return to (then it never will)."""
    if share_before_fault(requests, target, timeline) == 0:
        return True
    so_far = replace(timeline, end_s=now_s - RETURN_LAG_S)
    return time_to_return(requests, target, so_far) is not None


def health_times(polls: Sequence[dict[str, Any]], timeline: Timeline,
                 workers: int) -> tuple[float | None, float | None]:
    """(fault -> first stale answer, cleared -> first connected answer seeing all workers)."""
    detect = next((p["t_s"] - timeline.fault_s for p in polls
                   if p["t_s"] >= timeline.fault_s and p.get("redis_connected") is False), None)
    recover = next((p["t_s"] - timeline.cleared_s for p in polls
                    if p["t_s"] >= timeline.cleared_s and p.get("redis_connected") is True
                    and p.get("workers", 0) >= workers), None)
    return detect, recover


def failures(requests: Iterable[RequestResult]) -> dict[str, int]:
    counted = {"before_first_byte": 0, "mid_stream": 0}
    for r in requests:
        if r.failure is not None:
            counted[r.failure] += 1
    return {"total": sum(counted.values()), **counted}


def phase_stats(requests: Sequence[RequestResult], timeline: Timeline) -> dict[str, Any]:
    """Per phase: requests, failures, TTFT P50/P99 (ms), share served by each region."""
    stats: dict[str, Any] = {}
    for phase in ("before", "during", "after"):
        chosen = [r for r in requests if timeline.phase(r.start_s) == phase]
        ttfts = [t for r in chosen if r.ok and (t := r.ttft_ms) is not None]
        regions: dict[str, int] = {}
        for r in chosen:
            if r.region is not None and r.ok:
                regions[r.region] = regions.get(r.region, 0) + 1
        stats[phase] = {
            "requests": len(chosen),
            "failed": failures(chosen),
            "retried": sum(1 for r in chosen if r.retried),
            "hedged": sum(1 for r in chosen if r.hedged),
            "ttft_p50_ms": _round(percentile(ttfts, 50)),
            "ttft_p99_ms": _round(percentile(ttfts, 99)),
            "served_by_region": dict(sorted(regions.items())),
        }
    return stats


def per_second(requests: Sequence[RequestResult], end_s: float,
               target: Target | None = None) -> list[dict[str, Any]]:
    """One row per second of request starts: served per region (and by the target),
    errors, retries, TTFT P99."""
    rows: list[dict[str, Any]] = []
    seconds = max(1, math.ceil(end_s))
    buckets: list[list[RequestResult]] = [[] for _ in range(seconds)]
    for r in requests:
        index = int(r.start_s)
        if 0 <= index < seconds:
            buckets[index].append(r)
    for second, bucket in enumerate(buckets):
        by_region: dict[str, int] = {}
        for r in bucket:
            if r.ok and r.region is not None:
                by_region[r.region] = by_region.get(r.region, 0) + 1
        ttfts = [t for r in bucket if r.ok and (t := r.ttft_ms) is not None]
        rows.append({
            "second": second,
            "requests": len(bucket),
            "served_by_region": by_region,
            "failed_before_first_byte": sum(r.failure == "before_first_byte" for r in bucket),
            "failed_mid_stream": sum(r.failure == "mid_stream" for r in bucket),
            "retried": sum(r.retried for r in bucket),
            "ttft_p99_ms": _round(percentile(ttfts, 99)),
            "served_by_target": sum(1 for r in bucket if r.ok and target and target.serves(r)),
        })
    return rows


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)
