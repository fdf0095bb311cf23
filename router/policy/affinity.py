"""Which worker last served a session or a long shared prompt prefix (router-local, bounded).

Sending such a request back to that worker lets the engine reuse its prefix cache. The
policy only follows the table while the remembered worker is predicted to be nearly as
fast as the best choice: following affinity onto an overloaded worker is the cache-miss
spiral other routers fall into.
"""

from __future__ import annotations

from collections import OrderedDict


class AffinityTable:
    """An LRU map from session ids and prefix keys to the worker that last served them
    and how many of that request's prompt tokens it holds in its prefix cache since."""

    __slots__ = ("_capacity", "_entries", "hits", "lookups")

    def __init__(self, capacity: int = 100_000) -> None:
        self._capacity = capacity
        self._entries: OrderedDict[str | int, tuple[str, int]] = OrderedDict()
        self.lookups = 0
        self.hits = 0

    def lookup(self, session_id: str | None, prefix_key: int | None
               ) -> tuple[str, int] | None:
        """(worker id, cached prompt tokens) of the session, else of the prefix key."""
        for key in (session_id, prefix_key):
            if key is None:
                continue
            self.lookups += 1
            entry = self._entries.get(key)
            if entry is not None:
                self.hits += 1
                self._entries.move_to_end(key)
                return entry
        return None

    def remember(self, session_id: str | None, prefix_key: int | None, worker_id: str,
                 *, prompt_tokens: int = 0, prefix_tokens: int = 0) -> None:
        """`worker_id` served a request of the session (its whole prompt, `prompt_tokens`,
        is now in that worker's prefix cache: the next turn repeats it) and of the prefix
        key (only the first `prefix_tokens` are shared by other prompts with that key)."""
        for key, tokens in ((session_id, prompt_tokens), (prefix_key, prefix_tokens)):
            if key is None:
                continue
            self._entries[key] = (worker_id, tokens)
            self._entries.move_to_end(key)
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)
