"""How many batch-class sequences each worker may hold: what interactive traffic leaves.

Batch lines run in the same engine as interactive requests, and an engine does not make
room for a new request until a running one finishes (vLLM admits by `max_num_seqs`, and
its priority scheduling preempts only when KV blocks run out). A 64-token batch line holds
its slot for over a second, so an interactive request that finds a worker's slots full of
batch lines waits that long for its first token. Batch traffic therefore never takes the
slots that the worker's interactive load may need:

- **adaptive** (the default): each worker keeps free the peak of the interactive load it
  carried lately, plus a margin. The peak rises to what two heartbeats in a row have
  shown and falls back by `PEAK_DECAY_PER_S` slots per second, so it holds the
  interactive load's swings over the last tens of seconds, not its average.
  - Interactive load is the worker's load (predicted_ttft.effective_load) less the batch
    lines open there, this router's and its peer replicas' (sibling processes included,
    as their last reports said: router.registry.peers), and less the echoes of its own
    requests (router.registry.inflight: a guess at what same-region siblings sent
    meanwhile, which their reports replace). Batch lines hold slots all the same, so
    the room left is the slots less the peak, the margin and every batch line there.
    Counted as interactive, a peer's lines and an own line's echo stayed in the peak
    for tens of seconds after they ended, and two replicas sharing a batch ran fewer
    lines than one. A peer from before reports carried its lines still has them counted
    as interactive: the reserve is then larger than it needs to be, never smaller.
  - The load is seen at every look for room: the runner looks at every worker 20 times a
    second while lines wait (router.batch.runner), and a line's routing at each
    candidate. Interactive requests' routing does not look: it is the hot path, and a
    request holds its slot for many looks. A load counts once two heartbeats have shown
    it (`seen`).
  - A worker first seen, or not seen for `FORGET_S`, starts at three quarters of its
    slots, falling back faster for its first `LEARN_S`: a batch ramps up over seconds
    instead of filling slots before any swing was seen.
  - A quarter of the slots is also kept free after everything that runs, as the fixed
    rule does.
- **fixed**: regions.yaml's `batch.interactive_reserve`, a share of each worker's slots
  kept free after everything that runs (0.25 was the only rule before; it let a batch
  take 12 of 16 slots while interactive load swung from 5 to over 10, and a 10,000-line
  batch made the interactive TTFT p99 3.9x).

**Replicas share a worker's room.** Every replica that holds lines for a worker's models
(its own, and each peer whose last report said so: `"batch_ready"`) may fill only its
share of the room there: the room for all batch lines (what the rule leaves, before any
line is counted), split evenly, the remainder to the replicas first by id. A replica
sees another's lines only once its report arrives (every 50 ms or so), and the heartbeats
miss lines on their way, so two replicas that each filled the whole room put up to twice
its lines on a worker under a busy CPU. With shares, what the replicas start cannot pass
the room, whenever each learns of the other's lines. A replica with no lines waiting is
not counted: the others may fill what it leaves.

Used by the `batch` class's choice of worker (router.policy.predicted_ttft) and by the
batch runner's pacing (router.batch.runner), so both see the same room.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from router.registry.inflight import InFlight
from router.registry.worker_view import WorkerView

MIN_RESERVE_SHARE = 0.25  # of a worker's slots, free after all that runs (both modes)
MARGIN_SLOTS = 2  # kept free beyond the interactive peak
PEAK_DECAY_PER_S = 0.1  # slots per second the remembered peak falls back
FORGET_S = 30.0  # a peak not refreshed for this long is not trusted
# A worker first seen (or seen again after FORGET_S) has shown none of its swings yet: for
# LEARN_S its peak is at least a guess that starts at this share of its slots and falls
# LEARN_DECAY_PER_S, so a batch's first lines ramp up over seconds.
START_SHARE = 0.75
LEARN_S = 10.0
LEARN_DECAY_PER_S = 1.0


class BatchRoom:
    """Per worker: the interactive peak and this router's open batch lines (module doc)."""

    __slots__ = ("_batch", "_inflight", "_peaks", "_prune_at", "fixed_share", "me", "ready")

    def __init__(self, fixed_share: Callable[[], float | None] = lambda: None,
                 inflight: InFlight | None = None, me: str = "") -> None:
        # regions.yaml's batch.interactive_reserve (None: adaptive), read at every look.
        self.fixed_share = fixed_share
        # The router's open requests (the load `room` is given counts them): the peers'
        # batch lines as they last reported them, and the echoes of its own requests.
        self._inflight = InFlight() if inflight is None else inflight
        # worker: [peak, when seen, the heartbeat it was seen in (its receipt time), the
        # least interactive load seen in that heartbeat, the least seen in the one before,
        # when it was first seen]
        self._peaks: dict[str, list[float]] = {}
        self._batch: dict[str, int] = {}  # worker: this router's batch lines open there
        self._prune_at = 64  # peaks kept before the stale ones (workers gone) are dropped
        # This replica's id (router.registry.peers), and the models it holds Batch API
        # lines for (router.batch.runner sets it; its peers are told): who shares a room.
        self.me = me
        self.ready: frozenset[str] = frozenset()

    def started(self, worker_id: str) -> None:
        """A batch-class attempt was sent to the worker."""
        self._batch[worker_id] = self._batch.get(worker_id, 0) + 1

    def finished(self, worker_id: str) -> None:
        """A batch-class attempt on the worker ended, however it ended."""
        left = self._batch.get(worker_id, 0) - 1
        if left > 0:
            self._batch[worker_id] = left
        else:
            self._batch.pop(worker_id, None)

    def batch_of(self, worker_id: str) -> int:
        """This router's batch lines open on the worker."""
        return self._batch.get(worker_id, 0)

    def counts(self) -> dict[str, int]:
        """This router's batch lines per worker (a copy: the peers are told it)."""
        return dict(self._batch)

    def room(self, view: WorkerView, load: int, now_s: float) -> int:
        """Batch lines the worker may take now, its `load` (sequences running or waiting
        there: predicted_ttft.effective_load) seen now; the interactive peak is updated
        with it. Can be negative (interactive load took back what batch lines hold)."""
        fixed = self.fixed_share()
        slots = view.heartbeat.capacity.max_num_seqs
        worker_id = view.worker_id
        mine = self._batch.get(worker_id, 0)
        here = mine + self._inflight.peer_batch.get(worker_id, 0)  # batch lines open there
        # What all batch lines there may hold, this replica's and its peers'.
        whole = _fixed_room(slots, load, fixed) + here
        if fixed is None:
            peak = self.seen(worker_id, slots, view.received_at_s, load, now_s)
            whole = min(whole, slots - math.ceil(peak) - MARGIN_SLOTS)
        return min(whole - here, self.share(view, whole) - mine)

    def share(self, view: WorkerView, whole: int) -> int:
        """This replica's share of `whole`, the room for every replica's batch lines on
        the worker: split evenly among the replicas that hold lines for its models, the
        remainder to those first by id (see the module doc)."""
        ready = self._inflight.peer_ready
        if not ready:
            return whole
        served, me = view.served, self.me
        sharers = ahead = 0
        for peer, models in ready.items():
            if any(model in models for model in served):
                sharers += 1
                ahead += peer < me
        if not sharers:
            return whole
        sharers += 1
        return whole // sharers + int(ahead < whole % sharers)

    def fixed_room(self, view: WorkerView, load: int, now_s: float) -> int:
        """The fixed rule: a share of the slots kept free after everything that runs
        (`batch.interactive_reserve`, else a quarter). A floor under the adaptive rule, and
        the rule for a client's batch-class requests, which come when they come. (`now_s`:
        `room`'s signature, for callers that choose between the two.)"""
        return _fixed_room(view.heartbeat.capacity.max_num_seqs, load, self.fixed_share())

    def seen(self, worker_id: str, slots: int, heartbeat_s: float, load: int,
             now_s: float) -> float:
        """The worker's `load` (of `slots`) seen now, in the heartbeat received at
        `heartbeat_s`: its interactive peak, updated.

        A load counts towards the peak only once two heartbeats have shown it. A heartbeat
        is taken before it arrives: lines that ended in between are still in its load but
        no longer in this router's count, so for one heartbeat the interactive load seems
        higher by them. Kept as a peak, that would hold slots back for tens of seconds.
        Interactive requests hold their slots across heartbeats. Counted up to `slots`: a
        queue longer than that (a burst, or a heartbeat's absurd load) needs every slot,
        and no more, so the peak falls back from the slots, not from the queue."""
        inflight = self._inflight
        not_interactive = (self._batch.get(worker_id, 0) + inflight.peer_batch.get(worker_id, 0)
                           + inflight.echoes_on(worker_id))
        interactive = float(min(slots, max(0, load - not_interactive)))
        state = self._peaks.get(worker_id)
        if state is None or now_s - state[1] > FORGET_S:
            peaks = self._peaks
            peaks[worker_id] = state = [interactive, now_s, heartbeat_s, interactive,
                                        interactive, now_s]
            if len(peaks) > self._prune_at:
                for stale in [w for w, kept in peaks.items() if now_s - kept[1] > FORGET_S]:
                    del peaks[stale]
                self._prune_at = 2 * len(peaks) + 64
        peak = state[0] - PEAK_DECAY_PER_S * (now_s - state[1])
        if heartbeat_s != state[2]:  # a new heartbeat
            state[2], state[4], state[3] = heartbeat_s, state[3], interactive
        elif interactive < state[3]:
            state[3] = interactive
        confirmed = min(interactive, state[4])
        if confirmed > peak:
            peak = confirmed
        state[0], state[1] = peak, now_s
        learning = now_s - state[5]
        if learning < LEARN_S:  # what its first look could not know: a guess, falling fast
            return max(peak, slots * START_SHARE - LEARN_DECAY_PER_S * learning)
        return peak

    def peak_of(self, worker_id: str) -> float | None:
        """The interactive peak seen on the worker (None: not seen), without the first
        guess of its LEARN_S."""
        state = self._peaks.get(worker_id)
        return None if state is None else state[0]


def _fixed_room(slots: int, load: int, fixed: float | None) -> int:
    return slots - math.ceil(slots * (MIN_RESERVE_SHARE if fixed is None else fixed)) - load
