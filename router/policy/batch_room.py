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
    lines this router has open there. A peer replica's batch lines count as interactive:
    they hold slots all the same, and the reserve is then larger than it needs to be,
    never smaller.
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

Used by the `batch` class's choice of worker (router.policy.predicted_ttft) and by the
batch runner's pacing (router.batch.runner), so both see the same room.
"""

from __future__ import annotations

import math
from collections.abc import Callable

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

    __slots__ = ("_batch", "_peaks", "_prune_at", "fixed_share")

    def __init__(self, fixed_share: Callable[[], float | None] = lambda: None) -> None:
        # regions.yaml's batch.interactive_reserve (None: adaptive), read at every look.
        self.fixed_share = fixed_share
        # worker: [peak, when seen, the heartbeat it was seen in (its receipt time), the
        # least interactive load seen in that heartbeat, the least seen in the one before,
        # when it was first seen]
        self._peaks: dict[str, list[float]] = {}
        self._batch: dict[str, int] = {}  # worker: this router's batch lines open there
        self._prune_at = 64  # peaks kept before the stale ones (workers gone) are dropped

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
        return self._batch.get(worker_id, 0)

    def room(self, view: WorkerView, load: int, now_s: float) -> int:
        """Batch lines the worker may take now, its `load` (sequences running or waiting
        there: predicted_ttft.effective_load) seen now; the interactive peak is updated
        with it. Can be negative (interactive load took back what batch lines hold)."""
        fixed = self.fixed_share()
        slots = view.heartbeat.capacity.max_num_seqs
        room = _fixed_room(slots, load, fixed)
        if fixed is not None:
            return room
        worker_id = view.worker_id
        peak = self.seen(worker_id, slots, view.received_at_s, load, now_s)
        return min(room, slots - math.ceil(peak) - MARGIN_SLOTS - self._batch.get(worker_id, 0))

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
        interactive = float(min(slots, max(0, load - self._batch.get(worker_id, 0))))
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
