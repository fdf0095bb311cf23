"""The spare capacity the fleet leaves for batch lines, from the simulator's own model.

A simulated engine (lab.sim.engine) runs every sequence it holds in one step that lasts
`prompt tokens admitted / prefill_tokens_per_s + (decode_step_ms + decode_step_ms_per_seq
x sequences) / 1000` seconds and gives each sequence one token. A line of P prompt tokens
and C completion tokens therefore holds its slot for about `P / prefill_tokens_per_s + C x
step`. The router lets batch lines take each worker's `max_num_seqs` less the interactive
reserve (router.policy's BATCH_SLOT_RESERVE, a quarter), less what runs there already
(router.batch.runner). So a worker whose interactive requests hold `i` slots on average
leaves `spare = batch_slots - i` slots, and could serve `spare / line_s` lines per second
with the engine holding `i + spare` sequences. The fleet's spare capacity is the sum over
workers.

What it leaves out, on purpose: the prefill of other requests' prompts that lengthens a
step (a few per cent with short prompts), the time a line spends in the router and on
loopback, and the gap between a slot freeing and the next line starting in it (the
router's heartbeat and dispatch cadence): those are what the benchmark measures the batch
path against.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from lab.devstack.loadgen import RequestResult
from router.config import SimulatedPool
from router.policy.batch_room import MIN_RESERVE_SHARE as BATCH_SLOT_RESERVE


@dataclass(frozen=True, slots=True)
class EngineSpeed:
    """One simulated worker's size and speed (regions.yaml's `simulated`)."""

    max_num_seqs: int
    decode_step_ms: float
    decode_step_ms_per_seq: float
    prefill_tokens_per_s: float

    @classmethod
    def of(cls, pool: SimulatedPool) -> EngineSpeed:
        return cls(pool.max_num_seqs, pool.decode_step_ms, pool.decode_step_ms_per_seq,
                   pool.prefill_tokens_per_s)

    @property
    def batch_slots(self) -> int:
        """Slots batch lines may hold when nothing else runs (the runner's arithmetic)."""
        return int(self.max_num_seqs * (1.0 - BATCH_SLOT_RESERVE))

    def step_ms(self, sequences: float) -> float:
        """One decode step with `sequences` in the batch, in ms (no prefill)."""
        return self.decode_step_ms + self.decode_step_ms_per_seq * sequences

    def request_s(self, sequences: float, prompt_tokens: float,
                  completion_tokens: float) -> float:
        """How long one request holds its slot, in s, with `sequences` in the batch."""
        return (prompt_tokens / self.prefill_tokens_per_s
                + completion_tokens * self.step_ms(sequences) / 1000.0)


@dataclass(frozen=True, slots=True)
class WorkerSpare:
    """What one worker could do for batch lines beside its interactive load."""

    worker: str
    region: str
    batch_slots: int
    interactive_seqs: float  # interactive requests open there on average (client-side)
    line_s: float  # one line's time in its slot with the worker's batch slots all full

    @property
    def spare_slots(self) -> float:
        return max(0.0, self.batch_slots - self.interactive_seqs)

    @property
    def lines_per_s(self) -> float:
        return self.spare_slots / self.line_s if self.line_s > 0 else 0.0


def worker_spare(worker: str, region: str, speed: EngineSpeed, interactive_seqs: float,
                 prompt_tokens: float, completion_tokens: float) -> WorkerSpare:
    """`worker`'s spare capacity for lines of that many tokens (see the module doc)."""
    spare = max(0.0, speed.batch_slots - interactive_seqs)
    line_s = speed.request_s(interactive_seqs + spare, prompt_tokens, completion_tokens)
    return WorkerSpare(worker, region, speed.batch_slots, interactive_seqs, line_s)


def open_by_worker(results: Iterable[RequestResult], start_s: float, end_s: float
                   ) -> dict[str, float]:
    """Requests open on each worker on average over [start_s, end_s] (their time open
    within the window, summed, over its length): Little's law, from the client's
    records (`worker` is the router's x-globalpool-worker answer header)."""
    length = end_s - start_s
    held: dict[str, float] = {}
    if length <= 0:
        return held
    for result in results:
        if result.worker is None:
            continue
        overlap = min(result.end_s, end_s) - max(result.start_s, start_s)
        if overlap > 0:
            held[result.worker] = held.get(result.worker, 0.0) + overlap
    return {worker: seconds / length for worker, seconds in held.items()}
