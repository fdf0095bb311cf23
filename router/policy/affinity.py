"""Which worker last served a session or a long shared prompt prefix (router-local, bounded).

Sending such a request back to that worker lets the engine reuse its prefix cache. The
policy only follows the table while the remembered worker is predicted to be nearly as
fast as the best choice: following affinity onto an overloaded worker is the cache-miss
spiral other routers fall into.
"""

from __future__ import annotations

from collections import OrderedDict

from router.core.parse import prefix_level_tokens
from router.registry.shared_sends import MAX_SHARED_SERVED, MAX_WROTE_PER_WORKER, SharedSends

# Workers remembered per session or prefix key, the most recent first: a prompt that
# several workers served (a busy holder made the router send it elsewhere) is cached on
# each of them until their engines evict it.
HOLDERS = 4
class AffinityTable:
    """An LRU map from session ids and prefix keys to the workers that last served them,
    each with how many of a request's prompt tokens that key says are in that worker's
    prefix cache since.

    A holder is dropped once this router has sent the worker more new tokens since (its
    requests' uncached prompts and their answers, `wrote`) than the worker's KV cache
    holds: the engine has evicted that prefix by then (vLLM reuses its least recently
    freed blocks first), even counting only this router's traffic (twin, prefix-heavy:
    a third of the remembered holders were stale so).
    """

    __slots__ = ("_cache_tokens", "_capacity", "_entries", "_written", "hits", "lookups",
                 "shared")

    def __init__(self, capacity: int = 100_000) -> None:
        self._capacity = capacity
        # key -> ((worker id, cached tokens, the worker's `_written` when it served it), ...)
        self._entries: OrderedDict[str | int, tuple[tuple[str, int, int], ...]] = OrderedDict()
        self._written: dict[str, int] = {}  # worker id -> new tokens sent it, in all
        self._cache_tokens: dict[str, int] = {}  # worker id -> its KV cache's size
        self.lookups = 0  # requests looked up
        self.hits = 0  # of those, found
        # Own sends kept for the peer replicas (None: no peers are told): each replica's
        # table then holds what all of them sent (`apply_peer`). Without it, a replica
        # sent a long shared prompt to a worker that lacked it while another held it
        # (twin, prefix-heavy: prefix hits 55 -> 68 %, P99 1,485 -> 990 ms).
        self.shared: SharedSends | None = None

    def sent(self, worker_id: str, cache_size: int | None, *, session_id: str | None,
             prefix_keys: tuple[int, ...], prompt_tokens: int, cached_tokens: int,
             completion_tokens: int | None) -> None:
        """A request was sent to the worker, whose KV cache holds `cache_size` tokens: it
        writes there its prompt less the `cached_tokens` it was scored as finding, and up
        to `completion_tokens` (`wrote`); then its session and prefix keys are remembered,
        as what that cache now holds newest (`remember`)."""
        tokens = min(prompt_tokens - cached_tokens + (completion_tokens or 0),
                     MAX_WROTE_PER_WORKER)  # (what the peers believe: see the constant)
        self.wrote(worker_id, tokens, cache_size)
        if session_id or prefix_keys:
            self.remember(session_id, prefix_keys, worker_id, prompt_tokens=prompt_tokens)
        shared = self.shared
        if shared is not None:
            if prefix_keys and len(shared.served) < MAX_SHARED_SERVED:
                shared.served.append((worker_id, prefix_keys, tokens))
            else:
                wrote = shared.wrote
                wrote[worker_id] = min(wrote.get(worker_id, 0) + tokens, MAX_WROTE_PER_WORKER)

    def take_shared(self) -> SharedSends | None:
        """The sends kept for the peers since the last call (None: none), and keep them
        from now on (the peer exchange calls it at every report)."""
        shared, self.shared = self.shared, SharedSends()
        return shared or None

    def apply_peer(self, shared: SharedSends) -> None:
        """A peer replica's sends (its `take_shared`, as its report carried them), taken
        as if this router had sent them: the tokens written to each worker's cache (its
        holders age by them), and the prefix keys each worker now holds. Session ids are
        not shared: a session's turns come back to its own replica."""
        for worker_id, tokens in shared.wrote.items():
            self.wrote(worker_id, tokens, None)
        for worker_id, prefix_keys, tokens in shared.served:
            self.wrote(worker_id, tokens, None)
            self.remember(None, prefix_keys, worker_id)

    def wrote(self, worker_id: str, tokens: int, cache_size: int | None) -> None:
        """A request that adds `tokens` to the worker's KV cache was sent to it; its cache
        holds `cache_size` tokens (None: unknown, and its holders are never dropped)."""
        written = self._written
        if len(written) >= self._capacity and worker_id not in written:
            written.clear()  # workers gone long ago; the others' holders look fresh
            self._cache_tokens.clear()
        written[worker_id] = written.get(worker_id, 0) + tokens
        if cache_size is not None:
            self._cache_tokens[worker_id] = cache_size

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
        written, sizes = self._written, self._cache_tokens
        for worker_id, tokens, mark in holders:
            size = sizes.get(worker_id)
            if size is not None and written.get(worker_id, 0) - mark > size:
                continue  # evicted by now
            if tokens > cached.get(worker_id, 0):
                cached[worker_id] = tokens

    def remember(self, session_id: str | None, prefix_keys: tuple[int, ...], worker_id: str,
                 *, prompt_tokens: int = 0) -> None:
        """`worker_id` served a request of the session (its whole prompt, `prompt_tokens`,
        is now in that worker's prefix cache: the next turn repeats it) and with these
        prefix keys (key number i covers the first `prefix_level_tokens(i)` tokens, which
        other prompts with that key share). After `wrote` for the same request."""
        mark = self._written.get(worker_id, 0)
        if session_id is not None:
            self._put(session_id, (worker_id, prompt_tokens, mark))
        for level, key in enumerate(prefix_keys):
            self._put(key, (worker_id, prefix_level_tokens(level), mark))
        entries = self._entries
        while len(entries) > self._capacity:
            entries.popitem(last=False)

    def _put(self, key: str | int, holder: tuple[str, int, int]) -> None:
        entries = self._entries
        holders = entries.get(key)
        if holders is None:
            entries[key] = (holder,)
            return
        worker_id = holder[0]
        entries[key] = (holder, *[
            other for other in holders if other[0] != worker_id][:HOLDERS - 1])
        entries.move_to_end(key)
