"""`predicted_ttft`: score every candidate by predicted time to first token, in ms.

    predicted_ttft_ms = RTT(origin -> worker region) + the region's learnt penalty
                        + predicted queue wait + predicted prefill + the first engine step

The prefill is the prompt's part that the worker's prefix cache lacks, and, while the
worker has a free batch slot, also the prompts this router sent it that have not had
their first byte yet (`InFlight.prefilling`): the engine prefills those before the new
one, or in the same step. On a queued worker the queue's price covers them.

One unit for every term, so a spill-over to a farther region happens exactly when the
farther region is predicted to answer first. The pick is herd-free: among candidates
within `near_equal_ms` of the best, two are drawn at random and the better one wins
(power of two choices), and load includes this router's own requests since the last
heartbeat.
"""

from __future__ import annotations

import math
import random
from operator import itemgetter
from typing import ClassVar

from router.core.outcome import Prediction
from router.policy.base import Policy, RoutingContext, two_of
from router.policy.filters import best_of_region, needs_room, region_open, skipped_workers
from router.policy.request import Decision, RouteRequest
from router.registry.inflight import InFlight
from router.registry.snapshot import RegionRanking, Snapshot
from router.registry.worker_view import WorkerView

_NO_OVERRUNS: dict[str, float] = {}


def effective_load(view: WorkerView, local_inflight_now: int) -> int:
    """Sequences running or waiting on the worker now, as best this router can tell.

    The heartbeat's running + waiting, adjusted by how this router's own open requests on
    the worker changed since the heartbeat arrived. Not floored at those open requests:
    to a distant region, requests on their way there and answers on their way back count
    as open here while they hold no batch slot there, and the floor cost the benchmark's
    twin 3 points of SLO attainment. A worker that never gets the requests (a partition)
    is found by stall detection instead (router.health.tracker, `check_stalls`).
    """
    return max(0, view.reported_load + local_inflight_now - view.inflight_at_receipt)


def predicted_ms(region_ms: float, engine_ms: float, tokens: int,
                 prefill_ms_per_token: float, queued_ahead: int,
                 queue_ms_per_request: float) -> float:
    """The TTFT predicted for a request on one worker, in ms: the one formula that every
    way of scoring uses.

    `region_ms`: the RTT to the worker's region plus what this router measured beyond
    its predictions there (`region_ms`). Queue wait: `queued_ahead`
    requests that cannot start until a batch slot frees (none when it is 0 or less),
    slots freeing at one per `queue_ms_per_request` (the worker's recent E2E over its
    slots). `engine_ms`: what every request pays there, `WorkerView.engine_ms`: a share
    of a service time when the KV cache is nearly full (`kv_pressure_ms`) and the engine
    step that makes the first token (`first_step_ms`: the worker's inter-token
    latency). Prefill: the `tokens` of the prompt not
    in the worker's prefix cache, at its measured rate. The terms are the worker view's
    (router.registry.worker_view.WorkerView); a region's least terms give a floor that no
    worker of it can beat. `prediction` gives the same total by its parts.
    """
    ms = region_ms + engine_ms + tokens * prefill_ms_per_token
    if queued_ahead > 0:
        ms += queued_ahead * queue_ms_per_request
    return ms


def queue_price_ms(view: WorkerView, inflight: InFlight, now_s: float) -> float:
    """How long each request ahead in the worker's queue holds a new one up (ms): a batch
    slot's service time over the slots. The service time is the worker's recent E2E, or,
    when longer, what this router's own open requests there still have to generate (at
    one token per engine step, if each generates all its max_tokens allows): right after
    short requests finished, a batch of long ones would otherwise look short (seen with
    real vLLM: 40 requests of 600 tokens priced by the 2-token answers before them).
    Only read for a worker with requests ahead (`queued_ahead > 0`)."""
    price = view.queue_ms_per_request
    held = inflight.remaining_ms(view.worker_id, view.first_step_ms, now_s) / view.slots
    return held if held > price else price


def region_ms(context: RoutingContext, region: str, origin: str | None,
              now_s: float) -> float:
    """A request's cost of going to `region` at all: RTT from its origin plus what this
    router measured beyond its predictions there lately (a slow or congested path that
    heartbeats cannot see)."""
    base = context.rtt_ms(origin, region) if origin else 0.0
    if context.health is not None:
        base += context.health.region_penalty_ms(region, now_s)
    return base


def prediction(context: RoutingContext, view: WorkerView, origin: str | None, tokens: int,
               region_cost_ms: float, now_s: float) -> Prediction:
    """`predicted_ms` for `view`, by its parts, for a prompt of which `tokens` are not in
    its prefix cache (the prompts sent ahead of it are added, as scoring does),
    `region_cost_ms` being `region_ms` (made once per decision, for the chosen worker:
    metrics, traces and the benchmark compare each with what happened)."""
    rtt_ms = context.rtt_ms(origin, view.region) if origin else 0.0
    inflight = context.inflight
    queued = view.queue_base + inflight.of(view.worker_id)
    queue_ms = view.kv_pressure_ms
    if queued > 0:
        queue_ms += queued * queue_price_ms(view, inflight, now_s)
    else:
        tokens += inflight.prefilling.get(view.worker_id, 0)
    return Prediction(rtt_ms, region_cost_ms - rtt_ms, queue_ms,
                      tokens * view.prefill_ms_per_token, view.first_step_ms)


def predict(context: RoutingContext, view: WorkerView, request: RouteRequest) -> Prediction:
    """The TTFT predicted for `request` on `view`, by its parts, as predicted_ttft scores it
    (without prefix-cache affinity): for the baselines, which choose otherwise but whose
    choices' outcomes are measured against the same model."""
    origin = request.origin_region
    now_s = context.clock()
    return prediction(context, view, origin, request.prompt_tokens,
                      region_ms(context, view.region, origin, now_s), now_s)


# Affinity is followed while the remembered worker is predicted within this much of the
# best (ms, or the share of the best's own prediction, whichever is larger).
AFFINITY_SLACK_MS = 50.0
AFFINITY_SLACK_SHARE = 0.25
_first = itemgetter(0)


def _one_of_the_best(scored: list[tuple[float, WorkerView]], limit_ms: float,
                     rng: random.Random) -> tuple[float, WorkerView]:
    """Of the candidates scored at most `limit_ms` (the best and those near-equal to it),
    the lower of two drawn at random (power of two choices), or the only one. Never
    raises for scores that compare with nothing (NaN: the snapshot's terms are finite, but
    a policy must not fail every request of a model over one odd score): with none
    within the limit, the first of the lowest."""
    near = [item for item in scored if item[0] <= limit_ms]
    if len(near) >= 2:
        first, second = two_of(near, rng)
        return first if first[0] <= second[0] else second
    return near[0] if near else min(scored, key=_first)


def _plain(request: RouteRequest) -> bool:
    """An interactive request with nothing that narrows or bends its choice: no data
    residency, drains, regions to avoid or session/prefix affinity (retries' excluded
    workers are allowed)."""
    return (request.traffic_class != "batch" and request.allowed_regions is None
            and not request.drained and not request.avoid_regions
            and request.session_id is None and not request.prefix_keys)


class PredictedTtft(Policy):
    """Lowest predicted TTFT wins; near-equal candidates are split by power of two choices.

    Affinity: a worker that served the request's session or long prefix recently is
    scored with that part of the prompt cached (router.policy.affinity), and the best of
    those workers is chosen while it is predicted nearly as fast as the best of all.
    Batch: the cheapest region with spare batch slots, within the request's TTFT budget
    when one is given.
    """

    name: ClassVar[str] = "predicted_ttft"

    def pick(self, snapshot: Snapshot, request: RouteRequest) -> Decision:
        """At scale, regions in order of the lowest TTFT they could offer, until the rest
        cannot come near the best found: the same choice as scoring every region.

        The general path (every region's candidates through the filters, then `choose`)
        serves small pools, batch traffic, retries that avoid a region, and any moment
        the health filter has something to filter.
        """
        if request.only_worker is not None or needs_room(snapshot, request):
            return super().pick(snapshot, request)  # one candidate, or sized by context
        ranked = snapshot.ranked.get(request.model)
        health = self.context.health
        quiet = health is None or health.quiet
        if ranked is None and quiet and _plain(request):
            decision = self._pick_plain(snapshot, request)
            if decision is not None:
                return decision
        if (ranked is None or request.traffic_class == "batch" or request.avoid_regions
                or not quiet):
            return super().pick(snapshot, request)
        context = self.context
        now_s = context.clock()
        freshness_now = snapshot.freshness_now(now_s)
        cached = self._cached(request)
        # the least uncached tokens of any worker: a region's floor
        tokens = request.prompt_tokens - max(cached.values(), default=0)
        origin = request.origin_region
        region_costs: dict[str, float] = {}
        floors: list[tuple[float, RegionRanking]] = []
        for ranking in ranked:
            if region_open(ranking.region, request):
                base = region_costs[ranking.region] = region_ms(context, ranking.region,
                                                                origin, now_s)
                floors.append((predicted_ms(base, ranking.min_engine_ms, tokens,
                                            ranking.min_prefill_ms_per_token, 0, 0.0), ranking))
        floors.sort(key=_first)
        skip = skipped_workers(request)
        within_ms = self._within_ms
        scored: list[tuple[float, WorkerView]] = []
        best_ms = math.inf
        for floor_ms, ranking in floors:
            if floor_ms > best_ms + within_ms(best_ms, bool(cached)):
                break  # neither the best, nor near-equal to it, nor an affine choice
            region_scored = self._score(best_of_region(ranking, skip, freshness_now),
                                        request, cached, region_costs, now_s)
            if region_scored:
                scored += region_scored
                best_ms = min(best_ms, min(score for score, _ in region_scored))
        if not scored:
            return super().pick(snapshot, request)  # says why there is no route
        return self._decide(scored, request, cached)

    def _pick_plain(self, snapshot: Snapshot, request: RouteRequest) -> Decision | None:
        """The general path's choice for the usual request to a pool too small to rank
        (see `_plain`), in one pass: the filters, `_score` and `_decide` inlined. Most
        requests of most fleets come this way, and the calls between those steps cost a
        quarter of a proxied request's CPU. None when no ready, fresh worker is left:
        the general path then says why, or falls back to degraded workers.
        """
        rows = snapshot.ready_terms(request.model)
        if not rows:
            return None
        context = self.context
        now_s = context.clock()
        freshness_now = snapshot.freshness_now(now_s)
        exclude = request.exclude
        inflight = context.inflight
        open_requests = inflight.counts
        prefilling = inflight.prefilling
        tokens = request.prompt_tokens
        origin = request.origin_region
        health = context.health
        overdue = _NO_OVERRUNS if health is None else health.overdue_ms
        region_costs: dict[str, float] = {}
        scored: list[tuple[float, WorkerView]] = []
        best_ms = math.inf
        for (view, worker_id, region, expires_at_s, engine_ms, prefill_ms_per_token,
             queue_base, queue_ms_per_request) in rows:
            if expires_at_s <= freshness_now or (exclude and worker_id in exclude):
                continue
            base = region_costs.get(region)
            if base is None:
                base = region_costs[region] = region_ms(context, region, origin, now_s)
            queued = queue_base + open_requests.get(worker_id, 0)
            uncached = tokens
            if queued > 0:
                queue_ms_per_request = queue_price_ms(view, inflight, now_s)
            else:  # the prompts sent there ahead of it (module doc)
                uncached += prefilling.get(worker_id, 0)
            score = predicted_ms(base, engine_ms, uncached, prefill_ms_per_token, queued,
                                 queue_ms_per_request)
            if overdue:  # its streams waiting now are later than this (Health.check_overdue)
                score += overdue.get(worker_id, 0.0)
            scored.append((score, view))
            if score < best_ms:
                best_ms = score
        if not scored:
            return None
        score, view = scored[0] if len(scored) == 1 else _one_of_the_best(
            scored, best_ms + context.near_equal_ms, context.rng)
        budget = request.ttft_budget_ms
        region = view.region
        # `__new__` directly: half the cost of `Decision(...)` (a named tuple's Python
        # `__new__` gets the keywords as a dict through the type's call)
        return Decision.__new__(Decision, worker=view, predicted_ttft_ms=score,
                                reason="local" if origin is None or region == origin
                                else "spillover", candidates=len(scored),
                                budget_met=None if budget is None else score <= budget,
                                prediction=prediction(context, view, origin, tokens,
                                                      region_costs[region], now_s))

    def _within_ms(self, best_ms: float, affine: bool) -> float:
        """How far above the best a candidate can still be chosen (`affine`: a worker
        that holds part of the prompt may be among them)."""
        near_ms = self.context.near_equal_ms
        if not affine:
            return near_ms
        return max(near_ms, AFFINITY_SLACK_MS, AFFINITY_SLACK_SHARE * best_ms)

    def choose(self, candidates: list[WorkerView], request: RouteRequest) -> Decision:
        cached = self._cached(request)
        scored = self._score(candidates, request, cached, {}, self.context.clock())
        if request.traffic_class == "batch":
            return self._choose_batch(scored, request, cached)
        return self._decide(scored, request, cached)

    def _cached(self, request: RouteRequest) -> dict[str, int]:
        """Worker id -> how many of the request's prompt tokens it should find in its
        prefix cache (router.policy.affinity: the session's earlier prompt, else the
        longest prefix it served); empty when no worker is known to hold any."""
        if request.session_id is None and not request.prefix_keys:
            return {}
        cached = self.context.affinity.lookup(request.session_id, request.prefix_keys)
        prompt_tokens = request.prompt_tokens
        for worker_id, tokens in cached.items():
            if tokens > prompt_tokens:
                cached[worker_id] = prompt_tokens
        return cached

    def _decide(self, scored: list[tuple[float, WorkerView]], request: RouteRequest,
                cached: dict[str, int]) -> Decision:
        context = self.context
        best_ms = min(score for score, _ in scored)
        if cached:
            affine = [item for item in scored if item[1].worker_id in cached]
            if affine:
                score, view = min(affine, key=_first)
                if score <= best_ms + max(AFFINITY_SLACK_MS, AFFINITY_SLACK_SHARE * best_ms):
                    return self._decision(view, score, "affinity", request, len(scored),
                                          cached)
        score, view = _one_of_the_best(scored, best_ms + context.near_equal_ms, context.rng)
        origin = request.origin_region
        reason = "local" if origin is None or view.region == origin else "spillover"
        return self._decision(view, score, reason, request, len(scored), cached)

    def _score(
        self, candidates: list[WorkerView], request: RouteRequest, cached: dict[str, int],
        region_costs: dict[str, float], now_s: float,
    ) -> list[tuple[float, WorkerView]]:
        # Region terms are computed once per region (kept in `region_costs`).
        context = self.context
        inflight = context.inflight
        open_requests = inflight.counts
        prefilling = inflight.prefilling
        prompt_tokens = request.prompt_tokens
        origin = request.origin_region
        health = context.health
        overdue = _NO_OVERRUNS if health is None else health.overdue_ms
        scored: list[tuple[float, WorkerView]] = []
        for view in candidates:
            region = view.region
            base = region_costs.get(region)
            if base is None:
                base = region_costs[region] = region_ms(context, region, origin, now_s)
            worker_id = view.worker_id
            tokens = prompt_tokens - cached.get(worker_id, 0) if cached else prompt_tokens
            queued = view.queue_base + open_requests.get(worker_id, 0)
            if queued > 0:
                score = predicted_ms(base, view.engine_ms, tokens, view.prefill_ms_per_token,
                                     queued, queue_price_ms(view, inflight, now_s))
            else:  # the prompts sent there ahead of it (module doc)
                score = predicted_ms(base, view.engine_ms, tokens + prefilling.get(worker_id, 0),
                                     view.prefill_ms_per_token, 0, 0.0)
            if overdue:  # its streams waiting now are later than this (Health.check_overdue)
                score += overdue.get(worker_id, 0.0)
            scored.append((score, view))
        return scored

    def _choose_batch(self, scored: list[tuple[float, WorkerView]], request: RouteRequest,
                      cached: dict[str, int]) -> Decision:
        context = self.context
        inflight = context.inflight
        batch_room = context.batch_room
        now_s = context.clock()
        # A batch line: into the room interactive traffic leaves (router.policy.batch_room).
        # A client's batch-class request comes when it comes: a slot beyond a fixed share.
        room = batch_room.room if request.paced else batch_room.fixed_room
        spare = [item for item in scored
                 if room(item[1], effective_load(item[1], inflight.of(item[1].worker_id)),
                         now_s) >= 1]
        budget = request.ttft_budget_ms
        if budget is not None:
            within = [item for item in spare if item[0] <= budget]
            spare = within or spare
        if not spare:
            # Every worker is busy with interactive work: the least bad place, marked so.
            score, view = min(scored, key=_first)
            return self._decision(view, score, "batch_queued", request, len(scored), cached)
        cost = context.region_cost
        score, view = min(spare, key=lambda item: (cost(item[1].region), item[0]))
        return self._decision(view, score, "batch", request, len(scored), cached)

    def _decision(self, view: WorkerView, score: float, reason: str, request: RouteRequest,
                  count: int, cached: dict[str, int]) -> Decision:
        """The decision for `view`, scored `score` with `cached` (see `_cached`)."""
        context = self.context
        origin = request.origin_region
        now_s = context.clock()
        cached_tokens = cached.get(view.worker_id, 0)
        parts = prediction(context, view, origin, request.prompt_tokens - cached_tokens,
                           region_ms(context, view.region, origin, now_s), now_s)
        budget = request.ttft_budget_ms
        return Decision(worker=view, predicted_ttft_ms=score, reason=reason, candidates=count,
                        budget_met=None if budget is None else score <= budget,
                        prediction=parts, cached_tokens=cached_tokens)
