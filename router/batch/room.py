"""How many of a batch's lines may start now (router.batch.runner): the spare slots of
the workers serving its model, or, for a model that nobody serves, as many as the
runner's own cap lets go, so that each is answered as an interactive request for it is;
and how many a runner holds ready for the slots that free up between its scans
(`StartPace`).

A model that no worker serves or served lately (router.registry.snapshot's
`knows_model`) and regions.yaml does not list gets 404 `model_not_found` at once on the
request path; a batch's lines held for a spare slot of such a model would wait until the
batch expires (24 h). They are let go, and each gets its 404 in the error file, once that
has held for UNHEARD_OF_GRACE_S on a fleet view read from Redis: a router that has just
started (no view yet) or lost Redis does not take a served model for an unknown one. A
model that regions.yaml lists, or whose workers are all busy, or absent for a restart
(remembered for MODEL_MEMORY_S), is never let go this way: its lines wait for a slot.
"""

from __future__ import annotations

import math
import time

from router.auth.keys import Principal
from router.config_reload import ConfigHolder
from router.policy.predicted_ttft import effective_load
from router.proxy.handlers import Proxy

UNHEARD_OF_GRACE_S = 5.0


class LineRoom:
    """The spare slots a batch's lines may start into (see the module doc)."""

    def __init__(self, proxy: Proxy, configs: ConfigHolder) -> None:
        self.proxy = proxy
        self.configs = configs
        self._unheard_since: dict[str, float] = {}  # model -> since when (policy clock)

    def slots(self, model: str, principal: Principal | None) -> int:
        """Batch slots free now on the fresh, ready workers serving `model` (in the
        regions `principal` may use): each worker's slots less what it keeps for
        interactive requests, less what runs or waits there (router.policy.batch_room).
        For a model unheard of: `batch.max_in_flight` (the lines get their 404)."""
        if self.unheard_of(model):
            return self.configs.current.batch.max_in_flight
        proxy = self.proxy
        snapshot = proxy.holder.current
        now = time.monotonic()
        fresh_now = snapshot.freshness_now(now)
        room = proxy.policy.context.batch_room.room
        allowed = None if principal is None else principal.allowed_regions
        spare = 0
        for view in snapshot.serving(model):
            if not view.ready or not view.fresh(fresh_now):
                continue
            if allowed is not None and view.region not in allowed:
                continue
            spare += max(0, room(view, effective_load(view, proxy.inflight.of(view.worker_id)),
                                 now))
        return spare

    def unheard_of(self, model: str) -> bool:
        """Whether requests for `model` are answered 404 model_not_found now, and have
        been for UNHEARD_OF_GRACE_S (see the module doc)."""
        snapshot = self.proxy.holder.current
        now = self.proxy.policy.context.clock()
        if (not snapshot.redis_connected or snapshot.knows_model(model, now)
                or model in self.configs.current.models):
            self._unheard_since.pop(model, None)
            return False
        return now - self._unheard_since.setdefault(model, now) >= UNHEARD_OF_GRACE_S

    def keep(self, models: set[str]) -> None:
        """Forget the models of batches that have ended."""
        for model in self._unheard_since.keys() - models:
            del self._unheard_since[model]


class StartPace:
    """How many lines a runner holds ready beyond the spare slots it sees at a scan: one
    for each line it runs, or as many as it started in a scan interval and a half,
    whichever is more. Holding only the spare slots' worth, a runner whose slots were
    full held none, and the slots that its lines freed between two scans stood idle
    until the next (up to a scan interval each time; bench-batch: 0.75 of the spare
    capacity, 0.79 with lines held ready)."""

    __slots__ = ("_since_s", "_starts", "rate")

    def __init__(self) -> None:
        self.rate = 0.0  # lines started per second, as of the last scan
        self._starts = 0
        self._since_s = time.monotonic()

    def started(self) -> None:
        self._starts += 1

    def measure(self, now_s: float) -> None:
        """At a scan: the rate since the last one (a drop is followed halfway a scan)."""
        if now_s > self._since_s:
            self.rate = max(self._starts / (now_s - self._since_s), self.rate / 2)
            self._starts, self._since_s = 0, now_s

    def ahead(self, running: int, interval_s: float) -> int:
        """Lines to hold ready for the slots that free up within the next `interval_s`."""
        return max(running, math.ceil(self.rate * interval_s * 1.5))
