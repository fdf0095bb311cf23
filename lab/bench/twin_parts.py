"""The twin's parts: a virtual clock shared by many engines, and a worker as its agent
reports it (lab.bench.twin)."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from lab.sim.engine import Engine
from lab.sim.sequence import Sequence as EngineSequence
from worker.engine_performance import prefill_busy_s, smoothed_rate
from worker.schema import Performance

HOLD_INTERVALS = 4  # as worker.engine_performance.PerformanceTracker


class SharedClock:
    """Virtual time for many engines: `sleep` waits until the driver reaches its due time."""

    def __init__(self) -> None:
        self.now_s = 0.0
        self._timers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    def now(self) -> float:
        return self.now_s

    async def sleep(self, seconds: float) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._timers, (self.now_s + max(0.0, seconds), next(self._order), future))
        await future

    def next_due(self) -> float | None:
        return self._timers[0][0] if self._timers else None

    def fire_due(self) -> None:
        while self._timers and self._timers[0][0] <= self.now_s:
            _, _, future = heapq.heappop(self._timers)
            if not future.done():
                future.set_result(None)


@dataclass
class TwinWorker:
    name: str
    region: str
    engine: Engine
    observer: EngineEvents
    slots: int
    in_transit: int = 0
    finished: list[EngineSequence] = field(default_factory=list)
    held: dict[str, tuple[float, int]] = field(default_factory=dict)
    seq: int = 0

    def performance(self) -> Performance:
        """As the agent reports it: means over the interval, each held for a few
        intervals when no request finished (worker.engine_performance.PerformanceTracker)."""
        done = [(s.arrival_s, s.scheduled_s, s.first_token_s, s.finished_s,
                 max(0, s.prompt.num_tokens - s.cached_tokens), len(s.output), s.last_token_s)
                for s in self.finished
                if s.scheduled_s is not None and s.first_token_s is not None
                and s.finished_s is not None and s.last_token_s is not None]
        self.finished.clear()
        fresh: dict[str, float] = {}
        if done:
            count = len(done)
            fresh["e2e_ms"] = 1000 * sum(end - arrival for arrival, _, _, end, *_ in done) / count
            fresh["ttft_ms"] = 1000 * sum(first - arr for arr, _, first, *_ in done) / count
            prefill_s = sum(first - scheduled for _, scheduled, first, *_ in done)
            decode_s = sum(last - first for _, _, first, _, _, _, last in done)
            decode_tokens = sum(max(0, generated - 1) for *_, generated, _ in done)
            decode_rate = (decode_tokens / decode_s if decode_tokens > 0 and decode_s > 0
                           else None)
            busy_s = prefill_busy_s(prefill_s, count, decode_rate)
            if busy_s > 0:
                # Computed tokens, as the agent counts them (worker.engine_performance
                # .computed_tokens): the prefix cache's hits are not prefilled.
                fresh["prefill_tokens_per_s"] = sum(d[4] for d in done) / busy_s
            if decode_rate is not None:
                # vLLM's inter-token latency histogram's mean, and the per-sequence
                # decode rate, as the agent reads them (the router's first-step term).
                fresh["itl_ms"] = 1000.0 / decode_rate
                fresh["decode_tokens_per_s"] = decode_rate
        values: dict[str, float] = {}
        for name in ("e2e_ms", "ttft_ms", "itl_ms", "prefill_tokens_per_s",
                     "decode_tokens_per_s"):
            if name in fresh:
                value = fresh[name]
                if name == "prefill_tokens_per_s":  # as the agent smooths it
                    value = smoothed_rate(self.held.get(name, (None, 0))[0], value)
                self.held[name] = (value, 0)
            elif name in self.held:
                value, age = self.held[name]
                self.held[name] = (value, age + 1)
                if age + 1 > HOLD_INTERVALS:
                    del self.held[name]
            if name in self.held:
                values[name] = self.held[name][0]
        return Performance(**values)


class EngineEvents:
    """Engine events the twin needs: finished sequences (for heartbeats and clients) and
    prefix-cache counters."""

    def __init__(self, on_finished: Callable[[EngineSequence], None],
                 on_first_token: Callable[[EngineSequence], None] = lambda seq: None) -> None:
        self._on_finished = on_finished
        self._on_first_token = on_first_token
        self.queried_tokens = 0
        self.hit_tokens = 0

    def on_admitted(self, seq: EngineSequence, queried_tokens: int, hit_tokens: int) -> None:
        self.queried_tokens += queried_tokens
        self.hit_tokens += hit_tokens

    def on_first_token(self, seq: EngineSequence) -> None:
        self._on_first_token(seq)

    def on_decode_token(self, inter_token_s: float) -> None:
        pass

    def on_step(self, scheduled_tokens: int, generated_tokens: int) -> None:
        pass

    def on_preempted(self, seq: EngineSequence) -> None:
        pass

    def on_finished(self, seq: EngineSequence) -> None:
        self._on_finished(seq)

    def on_rejected(self) -> None:
        pass
