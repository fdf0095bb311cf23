"""Which worker last served a session or a long shared prompt prefix (router-local, bounded).

Sending such a request back to that worker lets the engine reuse its prefix cache. The
policy only follows the table while the remembered worker is predicted to be nearly as
fast as the best choice: following affinity onto an overloaded worker is the cache-miss
spiral other routers fall into.
"""

from __future__ import annotations

from collections import OrderedDict


class AffinityTable:
    """An LRU map from session ids and prefix keys to worker ids."""

    __slots__ = ("_capacity", "_entries", "hits", "lookups")

    def __init__(self, capacity: int = 100_000) -> None:
        self._capacity = capacity
        self._entries: OrderedDict[str | int, str] = OrderedDict()
        self.lookups = 0
        self.hits = 0

    def worker_for(self, session_id: str | None, prefix_key: int | None) -> str | None:
        for key in (session_id, prefix_key):
            if key is None:
                continue
            self.lookups += 1
            worker_id = self._entries.get(key)
            if worker_id is not None:
                self.hits += 1
                self._entries.move_to_end(key)
                return worker_id
        return None

    def remember(self, session_id: str | None, prefix_key: int | None, worker_id: str) -> None:
        for key in (session_id, prefix_key):
            if key is None:
                continue
            self._entries[key] = worker_id
            self._entries.move_to_end(key)
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)
