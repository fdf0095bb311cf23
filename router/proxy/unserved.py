"""Workers that said they do not serve a model their heartbeat lists, kept from that
model's requests until their next heartbeat.

vLLM answers 404 "The model `X` does not exist." for a model it no longer serves (an
adapter unloaded, another model loaded); the router retries such a request elsewhere at
no cost to the worker's health (router.proxy.failures, `Failure.NOT_SERVED`). Until the
agent's next heartbeat says what the engine serves now, the same worker would be offered
the model's next requests, each one more refused attempt. And a worker whose engine says
so for good while its heartbeats go on listing the model (a lying or broken one) would
cost one for every request routed there. Here each such refusal keeps the worker from
the model until a heartbeat newer than the one the router had when it refused: at most
one refused attempt per worker, model and heartbeat in each router replica. When every
worker of the model has refused it, none is kept away (their next answers say whether
the model is back).
"""

from __future__ import annotations

from router.core.outcome import Failure
from router.policy.request import RouteRequest
from router.proxy.failures import UpstreamFailure
from router.registry.snapshot import Snapshot


class Unserved:
    """See the module doc. `by_model`: model -> {worker id: the `seq` of the worker's
    latest heartbeat the router had when it refused the model (the view's: each
    heartbeat of an agent brings a new one, in its load record if not in full)}."""

    __slots__ = ("by_model",)

    def __init__(self) -> None:
        self.by_model: dict[str, dict[str, int]] = {}

    def note(self, failed: UpstreamFailure, worker_id: str, model: str,
             snapshot: Snapshot) -> None:
        """An attempt on `worker_id` failed with `failed`: kept if it is such a refusal."""
        if failed.kind is not Failure.NOT_SERVED:
            return
        view = snapshot.workers.get(worker_id)
        if view is not None:
            self.by_model.setdefault(model, {})[worker_id] = view.seq

    def kept_from(self, route: RouteRequest, snapshot: Snapshot) -> RouteRequest:
        """`route`, with the workers that refused its model since their last heartbeat
        excluded (none when that would leave the model no worker)."""
        if not self.by_model:
            return route  # the common case: nobody refused
        refused = self.by_model.get(route.model)
        if refused is None:
            return route
        for worker_id, seq in list(refused.items()):
            view = snapshot.workers.get(worker_id)
            if view is None or view.seq != seq:  # gone, or a heartbeat since
                del refused[worker_id]
        if not refused:
            del self.by_model[route.model]
            return route
        if all(view.worker_id in refused for view in snapshot.serving(route.model)):
            return route
        return route._replace(exclude=route.exclude.union(refused))
