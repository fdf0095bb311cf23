"""What a router replica sent since its last peer report, for its peers' affinity tables
(router.policy.affinity keeps them; router.registry.peers carries them)."""

from __future__ import annotations

from typing import Protocol

# Prompts with prefix keys kept for one peer report at most (more are not shared: the
# peers' tables only miss them, as before sharing).
MAX_SHARED_SERVED = 1000
# Tokens sent to a worker's KV cache in one report, at most (a report claiming more is not
# believed, router.registry.peer_reports): a sender counts no more, so that a client's
# absurd max_tokens (10**12: the engine refuses it, the router counted it as sent) cannot
# get this replica's reports refused by every peer.
MAX_WROTE_PER_WORKER = 1_000_000_000


class SharedSends:
    """The prompts with prefix keys sent, in order: (worker id, prefix keys, tokens they
    write to its KV cache); and the tokens the others wrote to each worker's cache."""

    __slots__ = ("served", "wrote")

    def __init__(self) -> None:
        self.wrote: dict[str, int] = {}
        self.served: list[tuple[str, tuple[int, ...], int]] = []

    def __bool__(self) -> bool:
        return bool(self.wrote or self.served)


class SharedAffinity(Protocol):
    """An affinity table whose sends are shared with the peers (`shared`: where they are
    kept; None: not kept)."""

    shared: SharedSends | None

    def take_shared(self) -> SharedSends | None: ...

    def apply_peer(self, shared: SharedSends) -> None: ...
