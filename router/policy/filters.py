"""Filters every policy gets, applied before any scoring (no policy can forget them)."""

from __future__ import annotations

from router.policy.request import NoRoute, RouteRequest
from router.registry.snapshot import Snapshot, WorkerView


def eligible(snapshot: Snapshot, request: RouteRequest, now_s: float) -> list[WorkerView]:
    """Workers that serve the model, are `ready`, fresh and not yet tried for this request.

    Raises NoRoute with a reason a client can act on when none is left.
    """
    serving = snapshot.serving(request.model)
    if not serving:
        raise NoRoute(f"no pool serves the model {request.model!r}", model_known=False)
    freshness_now = snapshot.freshness_now(now_s)
    candidates = [
        view
        for view in serving
        if view.ready and view.fresh(freshness_now) and view.worker_id not in request.exclude
    ]
    if not candidates:
        if all(not view.fresh(freshness_now) for view in serving):
            raise NoRoute(f"no live worker serves the model {request.model!r}", model_known=False)
        raise NoRoute(f"no worker of model {request.model!r} can take a request now")
    return candidates
