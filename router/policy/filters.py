"""Filters every policy gets, applied before any scoring (no policy can forget them)."""

from __future__ import annotations

from router.policy.request import NoRoute, RouteRequest
from router.registry.snapshot import RegionRanking, Snapshot, WorkerView
from worker.schema import LifecycleState


def eligible(snapshot: Snapshot, request: RouteRequest, now_s: float) -> list[WorkerView]:
    """Workers that serve the model, are `ready`, fresh, not drained and not yet tried.

    With no `ready` worker left, `degraded` ones are tried rather than none (fail open:
    an agent reports `degraded` when its probe times out, which an engine busy on an
    overloaded machine can do while it still serves). Raises NoRoute with a reason a
    client can act on when none is left.
    """
    serving = snapshot.serving(request.model)
    if not serving:
        raise NoRoute(f"no pool serves the model {request.model!r}", model_known=False)
    if request.allowed_regions is not None:
        serving = in_allowed_regions(serving, request)
    freshness_now = snapshot.freshness_now(now_s)
    ranked = snapshot.ranked.get(request.model)
    if ranked is not None:
        candidates = _best_of_each_region(ranked, request, freshness_now)
    else:
        candidates = [
            view
            for view in serving
            if view.ready and view.fresh(freshness_now) and view.worker_id not in request.exclude
        ]
    if not candidates:
        candidates = [
            view
            for view in serving
            if view.heartbeat.state is LifecycleState.DEGRADED and view.fresh(freshness_now)
            and view.worker_id not in request.exclude
        ]
    if candidates and request.drained:
        candidates = not_drained(candidates, request)
        if not candidates:
            raise NoRoute(f"every worker of model {request.model!r} that could take the request "
                          "is drained")
    if not candidates:
        if request.allowed_regions is not None:
            raise NoRoute(f"no worker of model {request.model!r} in the regions this API key "
                          f"may use ({_regions(request)}) can take a request now",
                          code="region_unavailable")
        if all(not view.fresh(freshness_now) for view in serving):
            raise NoRoute(f"no live worker serves the model {request.model!r}", model_known=False)
        raise NoRoute(f"no worker of model {request.model!r} can take a request now")
    return candidates


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
    inside = tuple(view for view in serving if view.region in allowed)
    if not inside:
        raise NoRoute(f"no worker of model {request.model!r} is in the regions this API key "
                      f"may use ({_regions(request)}); it is not sent elsewhere",
                      code="region_unavailable")
    return inside


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
