"""Which worker last served a session or a long shared prompt prefix (router-local, bounded).

Sending such a request back to that worker lets the engine reuse its prefix cache. The
policy only follows the table while the remembered worker is predicted to be nearly as
fast as the best choice: following affinity onto an overloaded worker is the cache-miss
spiral other routers fall into.
"""

from __future__ import annotations

from collections import OrderedDict

from router.core.parse import prefix_level_tokens

# Workers remembered per session or prefix key, the most recent first: a prompt that
# several workers served (a busy holder made the router send it elsewhere) is cached on
# each of them until their engines evict it.
HOLDERS = 4


class AffinityTable:
    """An LRU map from session ids and prefix keys to the workers that last served them,
    each with how many of a request's prompt tokens that key says are in that worker's
    prefix cache since."""

    __slots__ = ("_capacity", "_entries", "hits", "lookups")

    def __init__(self, capacity: int = 100_000) -> None:
        self._capacity = capacity
        self._entries: OrderedDict[str | int, tuple[tuple[str, int], ...]] = OrderedDict()
        self.lookups = 0  # requests looked up
        self.hits = 0  # of those, found

    def lookup(self, session_id: str | None, prefix_keys: tuple[int, ...]) -> dict[str, int]:
        """Worker id -> the request's prompt tokens in that worker's prefix cache: its
        session's earlier prompt, or the longest of its prefix keys
        (router.core.parse.prefix_keys_of) that the worker served. Empty: none known."""
        self.lookups += 1
        cached: dict[str, int] = {}
        if session_id is not None:
            self._collect(session_id, cached)
        for key in prefix_keys:  # a worker's credit: the longest it served
            self._collect(key, cached)
        if cached:
            self.hits += 1
        return cached

    def _collect(self, key: str | int, cached: dict[str, int]) -> None:
        holders = self._entries.get(key)
        if holders is None:
            return
        self._entries.move_to_end(key)
        for worker_id, tokens in holders:
            if tokens > cached.get(worker_id, 0):
                cached[worker_id] = tokens

    def remember(self, session_id: str | None, prefix_keys: tuple[int, ...], worker_id: str,
                 *, prompt_tokens: int = 0) -> None:
        """`worker_id` served a request of the session (its whole prompt, `prompt_tokens`,
        is now in that worker's prefix cache: the next turn repeats it) and with these
        prefix keys (key number i covers the first `prefix_level_tokens(i)` tokens, which
        other prompts with that key share)."""
        if session_id is not None:
            self._put(session_id, worker_id, prompt_tokens)
        for level, key in enumerate(prefix_keys):
            self._put(key, worker_id, prefix_level_tokens(level))
        entries = self._entries
        while len(entries) > self._capacity:
            entries.popitem(last=False)

    def _put(self, key: str | int, worker_id: str, tokens: int) -> None:
        entries = self._entries
        holders = entries.get(key)
        if holders is None:
            entries[key] = ((worker_id, tokens),)
            return
        entries[key] = ((worker_id, tokens), *[
            holder for holder in holders if holder[0] != worker_id][:HOLDERS - 1])
        entries.move_to_end(key)
