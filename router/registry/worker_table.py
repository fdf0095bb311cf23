"""The collector's table of worker views, and the clock they age by.

Every path that feeds the collector (messages, load records, full reads) parses, checks and
stores views here; snapshots are built of it. Freshness runs on Redis's clock
(`last_ok_at_s`: the last time Redis delivered anything), not the wall clock: see
router.registry.collector.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Container
from typing import Protocol

from router.registry.pace import Pace
from router.registry.refusals import Refusals
from router.registry.worker_view import WorkerView
from worker.load_records import LoadRecord
from worker.schema import Heartbeat, LifecycleState, Refused, parse_heartbeat

Clock = Callable[[], float]
log = logging.getLogger("globalpool.registry")


class HeartbeatCheck(Protocol):
    """Decides whether a well-formed heartbeat is believed (router.registry.heartbeat_gate)."""

    def check(self, heartbeat: Heartbeat, *, via_pubsub: bool,
              payload: bytes | None = None) -> str | None:
        """None to accept, else why it is dropped. `payload`: the bytes it was parsed from."""
        ...

    def check_record(self, record: LoadRecord, payload: bytes, view: WorkerView) -> str | None:
        """The same for a load record (parsed from `payload`) meant for `view`. Asked only
        while `signing`: an unsigned record carries nothing else to check (the worker's
        region and endpoint were checked with its heartbeat)."""
        ...

    @property
    def signing(self) -> bool:
        """Whether heartbeats must be signed (then unsigned `gone:` messages are ignored)."""
        ...

    @property
    def rules(self) -> object:
        """The rules in force (another object after a reload of regions.yaml)."""
        ...

    def refused_by_rules(self, heartbeat: Heartbeat) -> str | None:
        """Why the rules in force refuse an accepted heartbeat now, or None."""
        ...


class WorkerTable:
    """The views by worker id (`views`, never replaced: the collector's parts hold it), the
    load records last read of them, and whether and when Redis last answered.

    `local_inflight(worker_id)`: this router's open requests on a worker, recorded in each
    view it makes; `on_down(view)`: called when a worker's heartbeat says it went from
    ready to degraded; `pace`: for how long a view stays fresh (Pace.next_read_s)."""

    def __init__(self, *, clock: Clock, local_inflight: Callable[[str], int],
                 gate: HeartbeatCheck | None, on_down: Callable[[WorkerView], None],
                 pace: Pace, refusals: Refusals) -> None:
        self.clock = clock
        self.local_inflight = local_inflight
        self._gate = gate
        self._on_down = on_down
        self._pace = pace
        self._refusals = refusals
        self.views: dict[str, WorkerView] = {}
        # Load records as last read, by region and worker id (bytes): unchanged ones are
        # skipped.
        self.records: dict[str, dict[bytes, bytes]] = {}
        self.connected = False
        self.last_ok_at_s: float | None = None
        self.parsed = 0  # heartbeats parsed and checked (messages and full reads)
        self._rules_seen = None if gate is None else gate.rules  # see `recheck`

    def parse(
        self, payload: str | bytes, now: float, *, via_pubsub: bool = False
    ) -> WorkerView | None:
        """The view of a heartbeat received at `now`, or None when it is refused (counted)."""
        self.parsed += 1
        try:
            heartbeat = parse_heartbeat(payload)
        except Refused as exc:
            self._refusals.refuse(exc.reason, str(exc))
            return None
        if self._gate is not None and self._gate.check(
                heartbeat, via_pubsub=via_pubsub,
                payload=payload.encode() if isinstance(payload, str) else payload):
            return None  # unsigned, forged, replayed or from a disallowed address: counted
        return WorkerView(
            heartbeat=heartbeat,
            received_at_s=now,
            inflight_at_receipt=self.local_inflight(heartbeat.worker_id),
            next_read_s=self._pace.next_read_s(),  # its records come at the reads
        )

    def store(self, view: WorkerView, *, force: bool) -> bool:
        """Keep `view` if it is newer than the worker's (`force`: a full read's, which may
        be the same report again). Whether the table changed."""
        current = self.views.get(view.worker_id)
        if current is not None and not view.newer_than(current):
            if not force or current.seq != view.seq:
                return False
            view = current  # same report seen again via a full read: keep its receipt time
        self.put(view, current)
        return True

    def put(self, view: WorkerView, current: WorkerView | None) -> None:
        """Keep `view` in place of the worker's `current` one, whatever their order (the
        caller decided), telling `on_down` when it says the worker went from ready to
        degraded."""
        if (current is not None and view is not current
                and view.heartbeat.state is LifecycleState.DEGRADED
                and current.heartbeat.state is LifecycleState.READY):
            self._on_down(view)
        self.views[view.worker_id] = view

    def drop(self, worker_id: str, worker: bytes) -> WorkerView | None:
        """Take a worker out of the table, and forget its load record as last read
        (`worker`: the record's field name), so that it is taken again if it comes back."""
        view = self.views.pop(worker_id, None)
        if view is not None:
            self.records.get(view.region, {}).pop(worker, None)
        return view

    def recheck(self) -> bool:
        """Judge every known worker's heartbeat again by the gate's rules in force, once
        after they change (a reload of regions.yaml), dropping those they now refuse.
        Whether any went."""
        gate = self._gate
        if gate is None or gate.rules is self._rules_seen:
            return False
        self._rules_seen = gate.rules
        refused = {worker_id: reason for worker_id, view in self.views.items()
                   if (reason := gate.refused_by_rules(view.heartbeat)) is not None}
        for worker_id in refused:
            self.drop(worker_id, worker_id.encode())
        if refused:
            log.warning("regions.yaml reloaded: %d known worker(s) no longer allowed, "
                        "dropped from the view (%s)", len(refused),
                        ", ".join(sorted(set(refused.values()))))
        return bool(refused)

    def forgive(self, stalled_s: float) -> bool:
        """No heartbeat could be received for `stalled_s` (this process was not running):
        that time does not count towards any worker's heartbeat age."""
        now = self.clock()
        next_read_s = self._pace.next_read_s()
        views = self.views
        for worker_id, view in views.items():
            views[worker_id] = view.received_again(
                min(now, view.received_at_s + stalled_s), next_read_s)
        return bool(views)

    def expire(self, queued: Container[bytes]) -> bool:
        """Drop the workers past their freshness on Redis's clock, except those with a
        heartbeat in `queued` (newer, waiting for the next build). Whether any went."""
        if not self.connected or self.last_ok_at_s is None:
            return False
        now = min(self.clock(), self.last_ok_at_s)  # Redis's clock: see the module doc
        expired = [w for w, v in self.views.items()  # v.fresh(now), inline: 10,000 x 4 Hz
                   if v.expires_at_s <= now and w.encode() not in queued]
        for worker_id in expired:
            self.drop(worker_id, worker_id.encode())
        return bool(expired)
