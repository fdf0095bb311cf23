"""Simple policies to compare against (`globalpool bench --policies ...`).

Each ignores some of what `predicted_ttft` uses, which is the point of a baseline:
- `round_robin`: every eligible worker in turn;
- `random`: uniformly at random;
- `least_load`: the fewest sequences per batch slot anywhere (ignores distance);
- `nearest`: only the client's own region, as siloed pools behave;
- `power_of_two`: two at random, the less loaded of them.
"""

from __future__ import annotations

from typing import ClassVar

from router.policy.base import Policy, RoutingContext, two_of
from router.policy.predicted_ttft import effective_load, predict
from router.policy.request import Decision, NoRoute, RouteRequest
from router.registry.worker_view import WorkerView


def _decision(context: RoutingContext, view: WorkerView, request: RouteRequest, reason: str,
              count: int) -> Decision:
    """The baseline's choice, with the TTFT predicted there (by the same model as
    predicted_ttft's, which the baseline does not choose by), so that every policy's
    prediction error can be measured."""
    if request.origin_region is not None and view.region != request.origin_region:
        reason = f"{reason}:spillover"
    prediction = predict(context, view, request)
    return Decision(worker=view, predicted_ttft_ms=prediction.total_ms, reason=reason,
                    candidates=count, prediction=prediction)


class RoundRobin(Policy):
    name: ClassVar[str] = "round_robin"

    def __init__(self, context: RoutingContext) -> None:
        super().__init__(context)
        self._turn = 0

    def choose(self, candidates: list[WorkerView], request: RouteRequest) -> Decision:
        ordered = sorted(candidates, key=lambda v: v.worker_id)
        view = ordered[self._turn % len(ordered)]
        self._turn += 1
        return _decision(self.context, view, request, "round_robin", len(candidates))


class RandomChoice(Policy):
    name: ClassVar[str] = "random"

    def choose(self, candidates: list[WorkerView], request: RouteRequest) -> Decision:
        return _decision(self.context, self.context.rng.choice(candidates), request, "random",
                         len(candidates))


class LeastLoad(Policy):
    name: ClassVar[str] = "least_load"

    def choose(self, candidates: list[WorkerView], request: RouteRequest) -> Decision:
        inflight = self.context.inflight

        def utilisation(view: WorkerView) -> float:
            load = effective_load(view, inflight.of(view.worker_id))
            return load / view.heartbeat.capacity.max_num_seqs

        best = min(utilisation(v) for v in candidates)
        tied = [v for v in candidates if utilisation(v) == best]
        return _decision(self.context, self.context.rng.choice(tied), request, "least_load",
                         len(candidates))


class Nearest(Policy):
    name: ClassVar[str] = "nearest"

    def choose(self, candidates: list[WorkerView], request: RouteRequest) -> Decision:
        local = [v for v in candidates if v.region == request.origin_region]
        if not local:
            raise NoRoute(f"no worker in the client's region {request.origin_region!r} "
                          "(policy nearest never leaves it)")
        inflight = self.context.inflight
        view = min(local, key=lambda v: (effective_load(v, inflight.of(v.worker_id)),
                                         self.context.rng.random()))
        return _decision(self.context, view, request, "nearest", len(candidates))


class PowerOfTwo(Policy):
    name: ClassVar[str] = "power_of_two"

    def choose(self, candidates: list[WorkerView], request: RouteRequest) -> Decision:
        if len(candidates) == 1:
            return _decision(self.context, candidates[0], request, "power_of_two", 1)
        first, second = two_of(candidates, self.context.rng)
        inflight = self.context.inflight

        def utilisation(view: WorkerView) -> float:
            load = effective_load(view, inflight.of(view.worker_id))
            return load / view.heartbeat.capacity.max_num_seqs

        view = first if utilisation(first) <= utilisation(second) else second
        return _decision(self.context, view, request, "power_of_two", len(candidates))
