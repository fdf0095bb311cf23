"""The drained set that routing obeys; kept apart from the store that shares it
(router.registry.drains) so that the compiled request path reads it natively."""

from __future__ import annotations

from dataclasses import dataclass

from router.registry.worker_view import WorkerView


@dataclass(frozen=True, slots=True)
class Drained:
    """Regions and workers an operator drained: they get no new requests.

    Drain flags live in Redis so that every router replica obeys them (router.registry.drains).
    """

    regions: frozenset[str] = frozenset()
    workers: frozenset[str] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.regions or self.workers)

    def covers(self, view: WorkerView) -> bool:
        return view.region in self.regions or view.worker_id in self.workers


NOTHING_DRAINED = Drained()
