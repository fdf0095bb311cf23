"""The routing contract: `policy.pick(snapshot, request) -> Decision`.

A policy is constructed once with what does not change per request (`RoutingContext`:
the RTT table, this router's in-flight counts, the clock and the random source), then
called once per attempt with the current snapshot and one `RouteRequest`. New signals
become fields of `RouteRequest`, not new methods. Policies register by name where they
are defined: `class Mine(Policy)` with `name = "mine"` in its body (a class attribute, not
a class keyword: the compiled build drops class keywords, mypy issue #21938).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, TypeVar

from router.health.tracker import Health
from router.policy.affinity import AffinityTable
from router.policy.batch_room import BatchRoom
from router.policy.filters import eligible
from router.policy.request import Decision, RouteRequest
from router.registry.inflight import InFlight
from router.registry.snapshot import Snapshot
from router.registry.worker_view import WorkerView

RttTable = Callable[[str, str], float]


@dataclass(frozen=True)
class RoutingContext:
    rtt_ms: RttTable
    inflight: InFlight = field(default_factory=InFlight)
    clock: Callable[[], float] = time.monotonic
    rng: random.Random = field(default_factory=random.Random)
    near_equal_ms: float = 5.0
    health: Health | None = None
    affinity: AffinityTable = field(default_factory=AffinityTable)
    region_cost: Callable[[str], float] = lambda _region: 1.0
    batch_room: BatchRoom = field(default_factory=BatchRoom)


class Policy:
    """Base class: subclasses set `name` and implement `choose` over filtered candidates."""

    registry: ClassVar[dict[str, type[Policy]]] = {}
    name: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        inherited = getattr(cls.__mro__[1], "name", "")
        if cls.name and cls.name != inherited:  # a name of its own
            if cls.name in Policy.registry:
                raise ValueError(f"policy {cls.name!r} is registered twice")
            Policy.registry[cls.name] = cls

    def __init__(self, context: RoutingContext) -> None:
        self.context = context

    def pick(self, snapshot: Snapshot, request: RouteRequest) -> Decision:
        """Filter (health, model, freshness...) then let the policy choose. Raises NoRoute."""
        now_s = self.context.clock()
        candidates = eligible(snapshot, request, now_s)
        if self.context.health is not None:
            candidates = self.context.health.filter(candidates, now_s)
        if request.avoid_regions:
            elsewhere = [c for c in candidates if c.region not in request.avoid_regions]
            candidates = elsewhere or candidates
        return self.choose(candidates, request)

    def choose(self, candidates: list[WorkerView], request: RouteRequest) -> Decision:
        raise NotImplementedError


T = TypeVar("T")


def two_of(items: list[T], rng: random.Random) -> tuple[T, T]:
    """Two different items drawn uniformly (`rng.sample(items, 2)`, at a fifth of its
    cost: this runs for most routing decisions)."""
    count = len(items)
    first = int(rng.random() * count)
    second = int(rng.random() * (count - 1))
    if second >= first:
        second += 1
    return items[first], items[second]
