"""The continuous-batching model: one loop that schedules, 'runs' a step, emits tokens.

Each iteration is one simulated forward pass, as in vLLM's v1 scheduler:

1. Every running sequence gets KV room for the token it feeds next. When the pool is
   short, the most recently admitted sequence is preempted (blocks freed, put back at the
   head of the queue, recomputed later), which vLLM counts in num_preemptions_total.
2. Waiting sequences are admitted first in, first out while a batch slot and enough free
   blocks exist; the queue head blocks the ones behind it, as in vLLM.
3. The step lasts prefill time of the admitted prompts (minus prefix-cache hits) plus a
   decode time that grows with the batch, all times the slow factor.
4. At the end of the step every sequence in the batch gets one token; newly admitted ones
   get their first. Sequences that reached max_tokens or their EOS finish and free their
   slot and blocks.

Simplifications: a whole prompt is prefilled in one step (no chunked prefill), and a
prefix-cache hit saves prefill time but not blocks (no block sharing between sequences).

Everything runs on the event loop with an injected `Clock`, so tests drive it in virtual
time. Metrics are reported through `EngineObserver` so the model knows nothing of
Prometheus.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from lab.sim.clock import Clock
from lab.sim.config import SimConfig
from lab.sim.kv import KvBlockPool, PrefixCache
from lab.sim.sequence import FinishReason, Sequence, SequenceState
from lab.sim.tokens import Prompt, WordSource


class QueueFullError(Exception):
    """The waiting queue holds max_num_queued_reqs requests; the caller answers 503."""


class EngineObserver(Protocol):
    """Receives the engine's events; `SimMetrics` turns them into vLLM's metrics."""

    def on_admitted(self, seq: Sequence, queried_tokens: int, hit_tokens: int) -> None: ...
    def on_first_token(self, seq: Sequence) -> None: ...
    def on_decode_token(self, inter_token_s: float) -> None: ...
    def on_step(self, scheduled_tokens: int, generated_tokens: int) -> None: ...
    def on_preempted(self, seq: Sequence) -> None: ...
    def on_finished(self, seq: Sequence) -> None: ...
    def on_rejected(self) -> None: ...


class NullObserver:
    def on_admitted(self, seq: Sequence, queried_tokens: int, hit_tokens: int) -> None:
        pass

    def on_first_token(self, seq: Sequence) -> None:
        pass

    def on_decode_token(self, inter_token_s: float) -> None:
        pass

    def on_step(self, scheduled_tokens: int, generated_tokens: int) -> None:
        pass

    def on_preempted(self, seq: Sequence) -> None:
        pass

    def on_finished(self, seq: Sequence) -> None:
        pass

    def on_rejected(self) -> None:
        pass


@dataclass(slots=True)
class _Step:
    batch: list[Sequence]
    prefilling: set[Sequence]
    num_tokens: int
    duration_s: float


class Engine:
    """One simulated GPU engine. Start `run()` as a task; `submit` and `abort` from handlers."""

    def __init__(
        self, config: SimConfig, clock: Clock, observer: EngineObserver | None = None
    ) -> None:
        self._config = config
        self._clock = clock
        self._observer: EngineObserver = observer or NullObserver()
        self._kv = KvBlockPool(config.kv_blocks, config.block_size)
        self._prefix_cache = PrefixCache(config.kv_blocks) if config.enable_prefix_caching else None
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._wakeup: asyncio.Event = asyncio.Event()
        self.slow_factor = config.slow_factor
        """Multiplies every step's duration (the `slow_factor` fault knob)."""
        self._running_steps = asyncio.Event()
        self._running_steps.set()
        self._aborts_held: list[tuple[Sequence, FinishReason]] = []

    @property
    def wedged(self) -> bool:
        """No step runs while set (the `wedge` fault knob); aborts wait until it is not."""
        return not self._running_steps.is_set()

    @wedged.setter
    def wedged(self, wedged: bool) -> None:
        if wedged:
            self._running_steps.clear()
            return
        self._running_steps.set()
        held, self._aborts_held = self._aborts_held, []
        for seq, reason in held:
            self.abort(seq, reason)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def running_sequences(self) -> tuple[Sequence, ...]:
        """The sequences in the batch now (a copy: for the benchmark's diagnostics)."""
        return tuple(self._running)

    @property
    def kv_usage(self) -> float:
        return self._kv.usage

    @property
    def kv_used_blocks(self) -> int:
        return self._kv.used_blocks

    def cached_prefix_tokens(self, prompt: Prompt) -> int:
        """Prompt tokens the prefix cache would serve if `prompt` were admitted now
        (read-only: the cache's order is untouched). For an observer that sees the
        engine's exact state, as the benchmark's oracle does."""
        if self._prefix_cache is None:
            return 0
        matched_blocks = self._prefix_cache.peek(prompt.block_hashes)
        return min(matched_blocks * self._config.block_size, prompt.num_tokens - 1)

    def now(self) -> float:
        return self._clock.now()

    def submit(
        self, request_id: str, prompt: Prompt, max_tokens: int, ignore_eos: bool = False
    ) -> Sequence:
        """Queue a request. Raises QueueFullError when max_num_queued_reqs are waiting.

        The caller has checked prompt + max_tokens <= max_model_len, which the config
        guarantees fits in the KV cache, so every accepted request can eventually run.
        """
        limit = self._config.max_num_queued_reqs
        if limit is not None and len(self._waiting) >= limit:
            self._observer.on_rejected()
            raise QueueFullError(
                f"Scheduler waiting queue is full ({limit} requests). "
                f"Cannot add request {request_id}."
            )
        words = WordSource(prompt.seed)
        eos_at = (
            None if ignore_eos else words.natural_length(self._config.eos_probability, max_tokens)
        )
        seq = Sequence(request_id, prompt, max_tokens, eos_at, words, self._clock.now())
        self._waiting.append(seq)
        self._wakeup.set()
        return seq

    def abort(self, seq: Sequence, reason: FinishReason = FinishReason.ABORT) -> None:
        """Stop a sequence now (client gone, injected fault); frees its slot and blocks."""
        if seq.finished:
            return
        if self.wedged:  # (an engine core that does not run takes no abort either)
            self._aborts_held.append((seq, reason))
            return
        if seq.state is SequenceState.WAITING:
            self._waiting.remove(seq)
        self._finish(seq, reason)

    async def run(self) -> None:
        """The engine loop; runs until cancelled, then aborts what is left."""
        try:
            while True:
                if not self._running and not self._waiting:
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                if self.wedged:
                    await self._running_steps.wait()
                    continue
                step = self._schedule()
                await self._clock.sleep(step.duration_s)
                self._complete(step)
        finally:
            self.abort_all()

    def abort_all(self) -> None:
        """Stop every sequence now (the engine stops: a wedged one too)."""
        self.wedged = False
        for seq in [*self._running, *self._waiting]:
            self.abort(seq)

    def _schedule(self) -> _Step:
        self._reserve_decode_blocks()
        prefilling: set[Sequence] = set()
        prefill_tokens = 0
        now = self._clock.now()
        while self._waiting and len(self._running) < self._config.max_num_seqs:
            seq = self._waiting[0]
            needed = self._kv.blocks_for(seq.num_tokens)
            if needed > self._kv.free_blocks:
                break
            self._waiting.popleft()
            self._kv.allocate(needed)
            seq.blocks = needed
            seq.state = SequenceState.RUNNING
            if seq.scheduled_s is None:
                seq.scheduled_s = now
            hit_tokens = self._query_prefix_cache(seq)
            seq.cached_tokens = hit_tokens
            # A preempted sequence recomputes its generated tokens too.
            prefill_tokens += seq.num_tokens - hit_tokens
            self._observer.on_admitted(seq, seq.prompt.num_tokens, hit_tokens)
            self._running.append(seq)
            prefilling.add(seq)
        batch = list(self._running)
        config = self._config
        decode_ms = config.decode_step_ms + config.decode_step_ms_per_seq * len(batch)
        duration_s = (prefill_tokens / config.prefill_tokens_per_s + decode_ms / 1000.0) * (
            self.slow_factor
        )
        num_tokens = prefill_tokens + len(batch) - len(prefilling)
        return _Step(batch, prefilling, num_tokens, duration_s)

    def _reserve_decode_blocks(self) -> None:
        """Give each running sequence room for its next token, preempting the newest."""
        index = 0
        while index < len(self._running):
            seq = self._running[index]
            needed = self._kv.blocks_for(seq.num_tokens) - seq.blocks
            while needed > self._kv.free_blocks:
                victim = self._running.pop()
                self._preempt(victim)
                if victim is seq:
                    return
            self._kv.allocate(needed)
            seq.blocks += needed
            index += 1

    def _preempt(self, seq: Sequence) -> None:
        self._kv.release(seq.blocks)
        seq.blocks = 0
        seq.state = SequenceState.WAITING
        seq.num_preemptions += 1
        self._waiting.appendleft(seq)
        self._observer.on_preempted(seq)

    def _query_prefix_cache(self, seq: Sequence) -> int:
        if self._prefix_cache is None:
            return 0
        matched_blocks = self._prefix_cache.match(seq.prompt.block_hashes)
        # As in vLLM, the last prompt token is always computed to produce logits.
        return min(matched_blocks * self._config.block_size, seq.prompt.num_tokens - 1)

    def _complete(self, step: _Step) -> None:
        now = self._clock.now()
        generated_tokens = 0
        for seq in step.batch:
            if seq.state is not SequenceState.RUNNING:
                continue  # aborted while the step ran
            generated_tokens += 1
            if seq in step.prefilling and self._prefix_cache is not None:
                self._prefix_cache.insert(seq.prompt.block_hashes)
            seq.output.append(seq.words.next_word())
            if seq.first_token_s is None:
                seq.first_token_s = now
                self._observer.on_first_token(seq)
            elif seq.last_token_s is not None:
                self._observer.on_decode_token(now - seq.last_token_s)
            seq.last_token_s = now
            generated = len(seq.output)
            if generated >= seq.max_tokens:
                self._finish(seq, FinishReason.LENGTH)
            elif seq.eos_at is not None and generated >= seq.eos_at:
                self._finish(seq, FinishReason.STOP)
            else:
                seq.notify()
        self._observer.on_step(step.num_tokens, generated_tokens)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.state is SequenceState.RUNNING:
            self._running.remove(seq)
            self._kv.release(seq.blocks)
            seq.blocks = 0
        seq.state = SequenceState.FINISHED
        seq.finish_reason = reason
        seq.finished_s = self._clock.now()
        self._observer.on_finished(seq)
        seq.notify()
