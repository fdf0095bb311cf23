"""Filters every policy gets, applied before any scoring (no policy can forget them)."""

from __future__ import annotations

from router.policy.request import NoRoute, RouteRequest
from router.registry.snapshot import RegionRanking, Snapshot
from router.registry.worker_view import WorkerView
from worker.schema import LifecycleState


def eligible(snapshot: Snapshot, request: RouteRequest, now_s: float) -> list[WorkerView]:
    """Workers that serve the model, are `ready`, fresh, not drained and not yet tried.

    With no `ready` worker left, `degraded` ones are tried rather than none (fail open:
    an agent reports `degraded` when its probe times out, which an engine busy on an
    overloaded machine can do while it still serves). Raises NoRoute with a reason a
    client can act on when none is left (`no_route` says which).
    """
    if request.only_worker is not None:
        return [the_only_worker(snapshot, request, now_s)]
    serving = snapshot.serving(request.model)
    if not serving:
        raise _no_worker(snapshot, request.model, now_s)
    freshness_now = snapshot.freshness_now(now_s)
    allowed = (serving if request.allowed_regions is None
               else in_allowed_regions(serving, request))
    sized = needs_room(snapshot, request)
    ranked = None if sized else snapshot.ranked.get(request.model)
    if ranked is not None:
        candidates = _best_of_each_region(ranked, request, freshness_now)
    else:
        candidates = [
            view
            for view in allowed
            if view.ready and view.fresh(freshness_now) and view.worker_id not in request.exclude
        ]
        if candidates and request.drained:
            candidates = not_drained(candidates, request)
    if not candidates:
        # (After the drains: a ready worker in a drained region must not keep the request
        # from a degraded one that is not drained.)
        candidates = [
            view
            for view in allowed
            if view.heartbeat.state is LifecycleState.DEGRADED and view.fresh(freshness_now)
            and view.worker_id not in request.exclude
        ]
        if candidates and request.drained:
            candidates = not_drained(candidates, request)
    if sized and candidates:
        candidates = fitting(candidates, request)
    if not candidates:
        raise no_route(serving, request, freshness_now)
    return candidates


def needs_room(snapshot: Snapshot, request: RouteRequest) -> bool:
    """Whether `request` may not fit the context of every worker of its model (then
    `fitting` chooses among them): it needs more than the shortest context, or a worker
    refused it as too long. One lookup for the usual request (the snapshot's cache)."""
    bounds = snapshot.context_bounds.get(request.model) or snapshot.contexts(request.model)
    return request.context_tokens > bounds[0] or request.context_above > 0


def fitting(candidates: list[WorkerView], request: RouteRequest) -> list[WorkerView]:
    """The candidates whose context fits `request`: longer than any that refused it
    (`context_above`, strict: the engine said so) and at least its `context_tokens` (an
    estimate). When none is long enough for the estimate, those with the longest context
    of the rest: the engine counts the prompt's tokens exactly, and says if it is too
    long. A worker that gives no length fits anything."""
    above = request.context_above
    usable = [view for view in candidates
              if (length := view.heartbeat.capacity.max_model_len) is None or length > above]
    need = request.context_tokens
    fit = [view for view in usable
           if (length := view.heartbeat.capacity.max_model_len) is None or length >= need]
    if fit or not usable:
        return fit
    longest = max(view.heartbeat.capacity.max_model_len or 0 for view in usable)
    return [view for view in usable if view.heartbeat.capacity.max_model_len == longest]


def the_only_worker(snapshot: Snapshot, request: RouteRequest, now_s: float) -> WorkerView:
    """The one worker that `request` may go to (`only_worker`), if it can take it now:
    live, serving the model, in an allowed region and not tried yet. Drained or draining,
    it still takes it: what the request continues exists nowhere else."""
    view = snapshot.workers.get(request.only_worker or "")
    model = request.model
    if view is None or not view.fresh(snapshot.freshness_now(now_s)):
        raise NoRoute(f"the worker that holds this conversation of the model {shown(model)} is "
                      "gone", code="model_unavailable")
    if model not in view.served:
        raise NoRoute(f"the worker that holds this conversation does not serve {shown(model)}",
                      code="model_unavailable")
    allowed = request.allowed_regions
    if allowed is not None and view.region not in allowed:
        raise NoRoute(f"this conversation is held outside the regions this API key may use "
                      f"({_regions(request)}); it is not sent there", code="region_unavailable")
    if view.worker_id in request.exclude or view.heartbeat.state not in _HOLDS_STATE:
        raise NoRoute(f"the worker that holds this conversation of the model {shown(model)} "
                      "cannot take it now")
    return view


def in_allowed_regions(
    serving: tuple[WorkerView, ...], request: RouteRequest
) -> tuple[WorkerView, ...]:
    """Data residency: only workers in `request.allowed_regions`, on every attempt.

    May empty the set (then NoRoute, a 503): a tenant limited to some regions is never
    served elsewhere, not even when those regions are down.
    """
    allowed = request.allowed_regions
    if allowed is None:
        return serving
    return tuple(view for view in serving if view.region in allowed)


def no_route(serving: tuple[WorkerView, ...], request: RouteRequest,
             freshness_now: float) -> NoRoute:
    """Why no worker of `serving` (every worker known to serve the model) can take the
    request, in order: none is live (`model_unavailable`); every live one is drained,
    draining or not yet ready, and some are drained or draining (`draining`); data
    residency forbids every region that has one that could (`region_unavailable`); else
    those left were tried already, or are starting (`no_capacity`). Only for the answer:
    it looks at every worker."""
    model = request.model
    live = [view for view in serving if view.fresh(freshness_now)]
    if not live:
        return NoRoute(f"no live worker serves the model {shown(model)}", code="model_unavailable")
    takers = [view for view in live if view.heartbeat.state in _TAKES_REQUESTS]
    drained = request.drained
    undrained = [view for view in takers if not drained.covers(view)]
    if not undrained and any(_draining(view, request) for view in live):
        return NoRoute(f"every live worker of the model {shown(model)} is draining or drained "
                       "(an operator's decision, or the workers are stopping)", code="draining")
    allowed = request.allowed_regions
    if allowed is not None and undrained and not any(view.region in allowed
                                                     for view in undrained):
        return NoRoute(f"no worker of the model {shown(model)} in the regions this API key may "
                       f"use ({_regions(request)}) can take a request now; it is not sent "
                       "elsewhere", code="region_unavailable")
    return NoRoute(f"no worker of the model {shown(model)} can take a request now")


# The most of a model's name that an error message echoes: a client may send megabytes.
MAX_SHOWN_MODEL_CHARS = 256


def shown(model: str) -> str:
    """`model` quoted for a message, cut to MAX_SHOWN_MODEL_CHARS characters."""
    if len(model) <= MAX_SHOWN_MODEL_CHARS:
        return repr(model)
    return repr(model[:MAX_SHOWN_MODEL_CHARS]) + f"... ({len(model)} characters)"

_TAKES_REQUESTS = frozenset({LifecycleState.READY, LifecycleState.DEGRADED})
# A worker that holds stored responses serves requests about them while it runs at all.
_HOLDS_STATE = _TAKES_REQUESTS | {LifecycleState.DRAINING}


def _no_worker(snapshot: Snapshot, model: str, now_s: float) -> NoRoute:
    """No worker serves `model`: one did lately (503), or maybe none ever did (404)."""
    if snapshot.knows_model(model, now_s):
        return NoRoute(f"no live worker serves the model {shown(model)}",
                       code="model_unavailable")
    return NoRoute(f"no worker serves the model {shown(model)} or has lately",
                   model_known=False, code="model_unavailable")


def _draining(view: WorkerView, request: RouteRequest) -> bool:
    return view.heartbeat.state is LifecycleState.DRAINING or request.drained.covers(view)


def _regions(request: RouteRequest) -> str:
    return ", ".join(sorted(request.allowed_regions or ()))


def not_drained(candidates: list[WorkerView], request: RouteRequest) -> list[WorkerView]:
    """Drop workers in a drained region and drained workers (an operator's decision).

    Unlike the health filter this may empty the set: a drain is obeyed even if that means
    a 503, because an operator drains a region to get traffic out of it.
    """
    drained = request.drained
    return [view for view in candidates if not drained.covers(view)]


# At scale, how many of each region's least-loaded eligible workers a decision considers.
SAMPLE_PER_REGION = 4


def _best_of_each_region(
    ranked: tuple[RegionRanking, ...], request: RouteRequest, freshness_now: float
) -> list[WorkerView]:
    """The first SAMPLE_PER_REGION eligible workers of every region, in load order.

    Scoring every one of thousands of workers costs milliseconds; the best candidate of
    a region is almost always among its least loaded few (this router's own in-flight
    requests since the heartbeat reorder only the top of the list).
    """
    skip = skipped_workers(request)
    candidates: list[WorkerView] = []
    for ranking in ranked:
        if region_open(ranking.region, request):
            candidates += best_of_region(ranking, skip, freshness_now)
    return candidates


def region_open(region: str, request: RouteRequest) -> bool:
    """Whether the request may go to `region` at all (data residency, drains)."""
    allowed = request.allowed_regions
    return (allowed is None or region in allowed) and region not in request.drained.regions


def skipped_workers(request: RouteRequest) -> frozenset[str]:
    """Workers the request must not go to: already tried, or drained."""
    drained = request.drained.workers
    return request.exclude | drained if drained else request.exclude


def best_of_region(
    ranking: RegionRanking, skip: frozenset[str], freshness_now: float
) -> list[WorkerView]:
    """The first SAMPLE_PER_REGION workers of a region's ranking that can take a request."""
    chosen: list[WorkerView] = []
    for view in ranking.views:
        if view.ready and view.expires_at_s > freshness_now and (
                not skip or view.worker_id not in skip):
            chosen.append(view)
            if len(chosen) == SAMPLE_PER_REGION:
                break
    return chosen
