"""Requests open against each worker, as this router knows them: its own, and the ones its
peer replicas reported, to see load between heartbeats.

Several router replicas read the same heartbeats; without these counts they would all
send to the momentarily best worker until its next heartbeat (herding). A heartbeat says
how loaded a worker was when it was taken; what was dispatched or finished since then is
the change in these counts, recorded when the heartbeat arrived. A router's own requests
count at once; its peers' count when their next report arrives (router.registry.peers,
every few tens of milliseconds), and a peer that stops reporting stops counting.

Between two reports, replicas behind the same regional front (they share its clients,
so their bursts come together) cannot see each other: twenty requests that reach each of
two replicas at once would all go to the workers each sees as best (measured: a 4-slot
worker got 13 while another region had 32 free slots). So each of this router's own
requests also counts once for every such sibling (`echo`), until the siblings' reports
can show what they really sent (two report intervals, `roll_echo`): each replica then
claims its share of the free slots, not all of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from router.core.outcome import Attempt

_NONE: dict[str, int] = {}


class InFlight:
    """Open requests per worker: this router's own, plus its peers' latest reports."""

    __slots__ = ("_echo_new", "_echo_old", "_open", "_own", "_own_prefill", "_peer_batch",
                 "_peer_prefill", "_peers", "_work", "echo", "peer_batch", "peer_ready",
                 "prefilling")

    def __init__(self) -> None:
        self._open: dict[str, int] = {}  # own + peers' + echoes: what routing reads
        self._own: dict[str, int] = {}
        self._peers: dict[str, tuple[float, dict[str, int]]] = {}  # id: (received, counts)
        # How many times each own request counts again (the siblings heard lately: set by
        # router.registry.peers), and the echoes of this report interval and the last.
        self.echo = 0
        self._echo_new: dict[str, int] = {}
        self._echo_old: dict[str, int] = {}
        # This router's open requests that said how many tokens they may generate, per
        # worker: [how many, their tokens, the sum of their start times]. See `remaining_ms`.
        self._work: dict[str, list[float]] = {}
        # Prompt tokens (not in the worker's prefix cache) of open requests on each worker
        # that have not had their first byte yet: prefill work queued there ahead of a new
        # request. This router's own, and its peers' as they last reported them; read by
        # routing as `prefilling.get(id, 0)`.
        self.prefilling: dict[str, int] = {}
        self._own_prefill: dict[str, int] = {}
        self._peer_prefill: dict[str, dict[str, int]] = {}
        # Of the peers' open requests, the Batch API lines per worker, as they last
        # reported them (router.policy.batch_room: what batch lines hold is not
        # interactive load).
        self.peer_batch: dict[str, int] = {}
        self._peer_batch: dict[str, dict[str, int]] = {}
        # Per peer: the models it holds Batch API lines for, waiting for room (its
        # replicas share a worker's room for them: router.policy.batch_room).
        self.peer_ready: dict[str, frozenset[str]] = {}

    def started(self, worker_id: str) -> None:
        self._own[worker_id] = self._own.get(worker_id, 0) + 1
        echo = self.echo
        self._open[worker_id] = self._open.get(worker_id, 0) + 1 + echo
        if echo:
            self._echo_new[worker_id] = self._echo_new.get(worker_id, 0) + echo

    def commit(self, attempt: Attempt, tokens: int, prefill_tokens: int,
               now_s: float) -> None:
        """An own attempt sent to its worker may generate `tokens` (its max_tokens; 0:
        unsaid), and has `prefill_tokens` of its prompt to prefill there: those count in
        `prefilling` until its first byte or its end (Attempt.end_prefill). Only a
        stream's: a whole answer's first byte comes with its last token, long after its
        prompt was prefilled (batch lines, unary clients: not seen, as before)."""
        worker_id = attempt.worker_id
        if prefill_tokens > 0 and attempt.streamed:
            attempt.prefill_tokens, attempt.prefilled = prefill_tokens, self.prefill_ended
            self.prefilling[worker_id] = self.prefilling.get(worker_id, 0) + prefill_tokens
            own = self._own_prefill
            own[worker_id] = own.get(worker_id, 0) + prefill_tokens
        if tokens <= 0:
            return
        attempt.committed_tokens = tokens
        work = self._work.get(worker_id)
        if work is None:
            self._work[worker_id] = [1.0, float(tokens), now_s]
        else:
            work[0] += 1.0
            work[1] += tokens
            work[2] += now_s

    def prefill_ended(self, worker_id: str, tokens: int) -> None:
        """An attempt `commit` counted in `prefilling` had its first byte, or ended."""
        if tokens > 0:
            _add(self.prefilling, worker_id, -tokens)
            _add(self._own_prefill, worker_id, -tokens)

    def own_prefill(self) -> dict[str, int]:
        """A copy of this router's own `prefilling` (what it reports to its peers)."""
        return dict(self._own_prefill)

    def release(self, worker_id: str, tokens: int, started_s: float) -> None:
        """The request `commit` counted has ended."""
        work = self._work.get(worker_id)
        if work is None:
            return
        if work[0] <= 1.0:
            del self._work[worker_id]
        else:
            work[0] -= 1.0
            work[1] -= tokens
            work[2] -= started_s

    def remaining_ms(self, worker_id: str, step_ms: float, now_s: float) -> float:
        """How long this router's open requests on the worker still run, on average, at
        one token per engine step (`step_ms`) if each generates all it may: the service
        time of the batch slots they hold, which the engine's recent E2E cannot know
        when they are longer than the requests that finished before them. 0: none said."""
        work = self._work.get(worker_id)
        if work is None:
            return 0.0
        count = work[0]
        return max(0.0, work[1] / count * step_ms - (now_s - work[2] / count) * 1000.0)

    def roll_echo(self) -> None:
        """One report interval has passed: the echoes of the one before it end (the
        siblings' own reports have had time to show what they sent meanwhile)."""
        old = self._echo_old
        if old:
            open_ = self._open
            for worker_id, count in old.items():
                _add(open_, worker_id, -count)
        self._echo_old, self._echo_new = self._echo_new, {}

    def finished(self, worker_id: str) -> None:
        own = self._own
        count = own.get(worker_id, 0)
        if count > 0:
            if count > 1:
                own[worker_id] = count - 1
            else:
                del own[worker_id]
            _add(self._open, worker_id, -1)

    def of(self, worker_id: str) -> int:
        """Open requests on the worker: this router's and its peers'."""
        return self._open.get(worker_id, 0)

    @property
    def counts(self) -> Mapping[str, int]:
        """`of` for every worker (absent: none), read-only: `counts.get(id, 0)` is the
        cheapest way to read many in a routing decision."""
        return self._open

    def own_of(self, worker_id: str) -> int:
        return self._own.get(worker_id, 0)

    def echoes_on(self, worker_id: str) -> int:
        """Echoes of this router's own requests counted on the worker now: a guess at
        what its siblings sent meanwhile, not load the worker has."""
        return self._echo_new.get(worker_id, 0) + self._echo_old.get(worker_id, 0)

    def echoes(self) -> int:
        """Echoed requests counted now (both intervals), for operators and tests."""
        return sum(self._echo_new.values()) + sum(self._echo_old.values())

    def own_counts(self) -> dict[str, int]:
        """A copy of this router's own counts (what it reports to its peers)."""
        return dict(self._own)

    def own_total(self) -> int:
        return sum(self._own.values())

    # --- peers ------------------------------------------------------------------------
    def apply_peer(self, peer_id: str, counts: Mapping[str, int], now_s: float,
                   prefill: Mapping[str, int] = _NONE, batch: Mapping[str, int] = _NONE,
                   ready: frozenset[str] = frozenset()) -> None:
        """`peer_id`'s latest report (its open requests per worker, the prompt tokens of
        those not yet prefilled, how many of them are Batch API lines, and the models it
        holds lines for) replaces its last."""
        _, previous = self._peers.get(peer_id, (0.0, _NONE))
        self._peers[peer_id] = (now_s, _replace(self._open, previous, counts))
        before = self._peer_prefill.get(peer_id, _NONE)
        if prefill or before:
            self._peer_prefill[peer_id] = _replace(self.prefilling, before, prefill)
        before = self._peer_batch.get(peer_id, _NONE)
        if batch or before:
            self._peer_batch[peer_id] = _replace(self.peer_batch, before, batch)
        if ready:
            self.peer_ready[peer_id] = ready
        else:
            self.peer_ready.pop(peer_id, None)

    def forget_peer(self, peer_id: str) -> None:
        """A peer that left (or went silent) stops counting."""
        _, previous = self._peers.pop(peer_id, (0.0, _NONE))
        _replace(self._open, previous, _NONE)
        _replace(self.prefilling, self._peer_prefill.pop(peer_id, _NONE), _NONE)
        _replace(self.peer_batch, self._peer_batch.pop(peer_id, _NONE), _NONE)
        self.peer_ready.pop(peer_id, None)

    def expire_peers(self, older_than_s: float) -> list[str]:
        """Forget peers whose last report arrived before `older_than_s`; their ids."""
        expired = [peer for peer, (at_s, _) in self._peers.items() if at_s < older_than_s]
        for peer_id in expired:
            self.forget_peer(peer_id)
        return expired

    def has_peer(self, peer_id: str) -> bool:
        return peer_id in self._peers

    def peer_count(self) -> int:
        return len(self._peers)

    def peer_ids(self) -> list[str]:
        """The peers counted now (cheaper than `peers` when their totals are not needed)."""
        return list(self._peers)

    def peers(self) -> dict[str, int]:
        """Each peer's total open requests, as it last reported them."""
        return {peer: sum(counts.values()) for peer, (_, counts) in self._peers.items()}


def _replace(totals: dict[str, int], previous: Mapping[str, int],
             latest: Mapping[str, int]) -> dict[str, int]:
    """One peer's `previous` figures in `totals` replaced by its `latest`; what was kept
    of them (the positive ones)."""
    for worker_id, count in previous.items():
        _add(totals, worker_id, -count)
    kept = {worker_id: count for worker_id, count in latest.items() if count > 0}
    for worker_id, count in kept.items():
        _add(totals, worker_id, count)
    return kept


def _add(counts: dict[str, int], worker_id: str, delta: int) -> None:
    value = counts.get(worker_id, 0) + delta
    if value > 0:
        counts[worker_id] = value
    else:
        counts.pop(worker_id, None)
