"""Building snapshots of the collector's worker table and making them current."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Generator
from dataclasses import replace

from router.registry.messages import MessageQueue
from router.registry.pace import Pace
from router.registry.snapshot import Snapshot, SnapshotHolder, finish
from router.registry.worker_table import WorkerTable


class SnapshotPublisher:
    """The only writer of `holder.current`: each build takes in the queued messages first,
    and paces the next one by what it cost (Pace.built)."""

    def __init__(self, *, holder: SnapshotHolder, table: WorkerTable,
                 messages: MessageQueue, pace: Pace) -> None:
        self._holder = holder
        self._table = table
        self._messages = messages
        self._pace = pace
        self._retired: Snapshot | None = None  # the snapshot last replaced (`_replace`)
        # Told after each snapshot is made current (router.registry.feed's `published`).
        self.on_published: Callable[[], None] = _nothing

    def publish(self) -> None:
        """Build and publish a snapshot at once (when the collector starts or loses Redis;
        while it follows the fleet, `publish_in_turns`)."""
        pace = self._pace
        started = time.thread_time()
        self._messages.apply()
        self._replace(finish(self._build_steps()), pace.spent(started))
        started = time.thread_time()
        self._retired = None
        pace.released_s = pace.spent(started)

    async def publish_in_turns(self) -> None:
        """Build and publish a snapshot with the event loop running between the build's
        steps, and free the one it replaces after another turn: a fleet of 10,000 takes
        ~10-20 ms to build and ~10 ms to free, and requests would wait for all of it. The
        thread CPU of the parts is summed (not the other tasks' in between)."""
        pace = self._pace
        started = time.thread_time()
        self._messages.apply()
        steps = self._build_steps()
        cost_s = 0.0
        while True:
            try:
                next(steps)
            except StopIteration as done:
                snapshot: Snapshot = done.value
                break
            cost_s += pace.spent(started)
            await asyncio.sleep(0)
            started = time.thread_time()
        self._replace(snapshot, cost_s + pace.spent(started))
        await asyncio.sleep(0)
        started = time.thread_time()
        self._retired = None
        pace.released_s = pace.spent(started)

    @property
    def current(self) -> Snapshot:
        return self._holder.current

    def restamp(self) -> None:
        """Make current the current snapshot again as of now: the same workers, views and
        rankings, with the table's Redis state and a new cache of scoring rows (for views
        changed in place: WorkerView.refresh). O(1) where a build is O(workers)."""
        table = self._table
        self._holder.current = replace(self._holder.current, built_at_s=table.clock(),
                                       redis_connected=table.connected,
                                       last_redis_ok_at_s=table.last_ok_at_s)

    def _build_steps(self) -> Generator[None, None, Snapshot]:
        """The build of a snapshot of the table as it is now (Snapshot.build_in_steps)."""
        table = self._table
        return Snapshot.build_in_steps(table.views.values(), built_at_s=table.clock(),
                                       redis_connected=table.connected,
                                       last_redis_ok_at_s=table.last_ok_at_s)

    def _replace(self, snapshot: Snapshot, cost_s: float) -> None:
        """Make `snapshot` current (the one it replaces is kept in `_retired`, for the
        caller to free), and pace the next build by what this one took."""
        self._retired = self._holder.current
        self._holder.current = snapshot
        self._pace.built(cost_s)
        self.on_published()


def _nothing() -> None:
    pass
