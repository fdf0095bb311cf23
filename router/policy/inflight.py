"""This router's own in-flight requests per worker, to see load between heartbeats.

Several router replicas read the same heartbeats; without their own counts they would all
send to the momentarily best worker until its next heartbeat (herding). A heartbeat says
how loaded a worker was when it was taken; what this router dispatched or finished since
then is the change in its own in-flight count, recorded when the heartbeat arrived.
"""

from __future__ import annotations

from collections.abc import Mapping


class InFlight:
    """Counts of requests this router has open against each worker."""

    __slots__ = ("_open",)

    def __init__(self) -> None:
        self._open: dict[str, int] = {}

    def started(self, worker_id: str) -> None:
        self._open[worker_id] = self._open.get(worker_id, 0) + 1

    def finished(self, worker_id: str) -> None:
        remaining = self._open.get(worker_id, 0) - 1
        if remaining > 0:
            self._open[worker_id] = remaining
        else:
            self._open.pop(worker_id, None)

    def of(self, worker_id: str) -> int:
        return self._open.get(worker_id, 0)

    @property
    def counts(self) -> Mapping[str, int]:
        """Open requests per worker (absent: none), read-only: `counts.get(id, 0)` is the
        cheapest way to read many in a routing decision."""
        return self._open

    def total(self) -> int:
        return sum(self._open.values())
