"""`predicted_ttft`: score every candidate by predicted time to first token, in ms.

    predicted_ttft_ms = RTT(origin -> worker region) + predicted queue wait + predicted prefill

One unit for every term, so a spill-over to a farther region happens exactly when the
farther region is predicted to answer first. The pick is herd-free: among candidates
within `near_equal_ms` of the best, two are drawn at random and the better one wins
(power of two choices), and load includes this router's own requests since the last
heartbeat.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.policy.base import Policy, RoutingContext
from router.policy.request import Decision, RouteRequest
from router.registry.snapshot import WorkerView

# Used until a worker has reported its own figures (no traffic yet).
DEFAULT_PREFILL_TOKENS_PER_S = 4000.0
DEFAULT_SERVICE_MS = 2000.0
# Above this KV usage new sequences start to wait for blocks even with free batch slots.
KV_PRESSURE_START = 0.9


@dataclass(frozen=True, slots=True)
class TtftEstimate:
    """The terms of one prediction, each in milliseconds."""

    rtt_ms: float
    queue_ms: float
    prefill_ms: float

    @property
    def total_ms(self) -> float:
        return self.rtt_ms + self.queue_ms + self.prefill_ms


def effective_load(view: WorkerView, local_inflight_now: int) -> int:
    """Sequences running or waiting on the worker now, as best this router can tell.

    The heartbeat's running + waiting, adjusted by how this router's own open requests on
    the worker changed since the heartbeat arrived.
    """
    load = view.heartbeat.load
    reported = load.running + load.waiting
    return max(0, reported + local_inflight_now - view.inflight_at_receipt)


def estimate_ttft(
    view: WorkerView, request: RouteRequest, rtt_ms: float, local_inflight_now: int
) -> TtftEstimate:
    heartbeat = view.heartbeat
    slots = heartbeat.capacity.max_num_seqs
    service_ms = heartbeat.performance.e2e_ms or DEFAULT_SERVICE_MS
    # Requests ahead of this one that cannot start until a batch slot frees; slots free
    # at a rate of `slots` per service time.
    queued_ahead = max(0, effective_load(view, local_inflight_now) + 1 - slots)
    queue_ms = queued_ahead * service_ms / slots
    kv_usage = heartbeat.load.kv_cache_usage
    if kv_usage is not None and kv_usage > KV_PRESSURE_START:
        pressure = (kv_usage - KV_PRESSURE_START) / (1.0 - KV_PRESSURE_START)
        queue_ms += pressure * service_ms
    rate = heartbeat.performance.prefill_tokens_per_s or DEFAULT_PREFILL_TOKENS_PER_S
    prefill_ms = 1000.0 * request.prompt_tokens / rate
    return TtftEstimate(rtt_ms=rtt_ms, queue_ms=queue_ms, prefill_ms=prefill_ms)


class PredictedTtft(Policy, name="predicted_ttft"):
    """Lowest predicted TTFT wins; near-equal candidates are split by power of two choices."""

    def choose(self, candidates: list[WorkerView], request: RouteRequest) -> Decision:
        context = self.context
        origin = request.origin_region
        scored: list[tuple[float, WorkerView]] = []
        for view in candidates:
            rtt = context.rtt_ms(origin, view.region) if origin else 0.0
            estimate = estimate_ttft(view, request, rtt, context.inflight.of(view.worker_id))
            scored.append((estimate.total_ms, view))
        best_ms = min(score for score, _ in scored)
        near = [item for item in scored if item[0] <= best_ms + context.near_equal_ms]
        if len(near) >= 2:
            first, second = context.rng.sample(near, 2)
            chosen = first if first[0] <= second[0] else second
        else:
            chosen = near[0]
        score, view = chosen
        reason = "local" if origin is None or view.region == origin else "spillover"
        return Decision(worker=view, predicted_ttft_ms=score, reason=reason,
                        candidates=len(candidates))


class RoundRobin(Policy, name="round_robin"):
    """Every eligible worker in turn, ignoring load and distance (a baseline)."""

    def __init__(self, context: RoutingContext) -> None:
        super().__init__(context)
        self._turn = 0

    def choose(self, candidates: list[WorkerView], request: RouteRequest) -> Decision:
        ordered = sorted(candidates, key=lambda v: v.worker_id)
        view = ordered[self._turn % len(ordered)]
        self._turn += 1
        return Decision(worker=view, predicted_ttft_ms=0.0, reason="round_robin",
                        candidates=len(candidates))
