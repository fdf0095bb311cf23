"""The continuous-batching model, in virtual time: exact timestamps, no waiting."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import pytest

from lab.sim.clock import VirtualClock
from lab.sim.config import SimConfig
from lab.sim.engine import Engine, NullObserver, QueueFullError
from lab.sim.sequence import FinishReason, Sequence
from lab.sim.tokens import Prompt, prompt_from_text

# Fast, simple numbers: 10 ms per decode step, no per-sequence cost, 1000 prompt tokens/s.
BASE = SimConfig(
    max_num_seqs=8,
    kv_blocks=256,
    block_size=16,
    prefill_tokens_per_s=1000.0,
    decode_step_ms=10.0,
    decode_step_ms_per_seq=0.0,
    max_model_len=1024,
)


def make_config(**changes: object) -> SimConfig:
    fields = {name: getattr(BASE, name) for name in BASE.__dataclass_fields__}
    fields.update(changes)
    return SimConfig(**fields)


class StepRecorder(NullObserver):
    """Samples the engine's load after every step (an EngineObserver)."""

    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.max_running = 0
        self.max_used_blocks = 0
        self.preemptions = 0

    def on_step(self, scheduled_tokens: int, generated_tokens: int) -> None:
        assert self.engine is not None
        self.max_running = max(self.max_running, generated_tokens)
        self.max_used_blocks = max(self.max_used_blocks, self.engine.kv_used_blocks)

    def on_preempted(self, seq: Sequence) -> None:
        self.preemptions += 1


EngineFactory = Callable[..., tuple[Engine, StepRecorder]]


@pytest.fixture
async def make_engine() -> AsyncIterator[EngineFactory]:
    tasks: list[asyncio.Task[None]] = []

    def factory(**changes: object) -> tuple[Engine, StepRecorder]:
        recorder = StepRecorder()
        engine = Engine(make_config(**changes), VirtualClock(), recorder)
        recorder.engine = engine
        tasks.append(asyncio.create_task(engine.run()))
        return engine, recorder

    yield factory
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def text_prompt(num_tokens: int, text: str = "x", block_size: int = 16) -> Prompt:
    return prompt_from_text((text * num_tokens * 4)[: num_tokens * 4], block_size, server_seed=0)


async def finish_all(seqs: Iterable[Sequence]) -> None:
    async with asyncio.timeout(5):
        await asyncio.gather(*(s.wait_finished() for s in seqs))


def ttft(seq: Sequence) -> float:
    assert seq.first_token_s is not None
    return seq.first_token_s - seq.arrival_s


def queue_time(seq: Sequence) -> float:
    assert seq.scheduled_s is not None
    return seq.scheduled_s - seq.arrival_s


async def test_one_request_timing_follows_the_model(make_engine: EngineFactory) -> None:
    engine, _ = make_engine()
    seq = engine.submit("r1", text_prompt(100), max_tokens=5)
    await finish_all([seq])
    # Step 1: 100 prompt tokens / 1000 per s + 10 ms decode; then 4 steps of 10 ms.
    assert ttft(seq) == pytest.approx(0.110)
    assert seq.finished_s is not None
    assert seq.finished_s - seq.arrival_s == pytest.approx(0.150)
    assert len(seq.output) == 5
    assert seq.finish_reason is FinishReason.LENGTH
    assert engine.num_running == 0
    assert engine.kv_used_blocks == 0


async def test_batch_never_exceeds_max_num_seqs(make_engine: EngineFactory) -> None:
    engine, recorder = make_engine(max_num_seqs=3)
    seqs = [engine.submit(f"r{i}", text_prompt(10), max_tokens=4) for i in range(7)]
    await finish_all(seqs)
    assert recorder.max_running == 3
    assert all(s.finish_reason is FinishReason.LENGTH for s in seqs)
    # The fourth starts only when one of the first three has finished.
    assert seqs[3].scheduled_s == seqs[0].finished_s


async def test_queueing_grows_wait(make_engine: EngineFactory) -> None:
    engine, _ = make_engine(max_num_seqs=1)
    seqs = [engine.submit(f"r{i}", text_prompt(10), max_tokens=3) for i in range(4)]
    await finish_all(seqs)
    waits = [queue_time(s) for s in seqs]
    assert waits[0] == 0.0
    assert waits == sorted(waits)
    assert len(set(waits)) == 4
    assert ttft(seqs[3]) > ttft(seqs[0]) + 3 * 0.02


async def test_kv_blocks_limit_admission(make_engine: EngineFactory) -> None:
    # 40-token prompts + 4 generated = 44 tokens = 3 blocks of 16; only one fits in 4.
    engine, recorder = make_engine(kv_blocks=4, max_model_len=64)
    seqs = [engine.submit(f"r{i}", text_prompt(40, text=str(i)), max_tokens=4) for i in range(3)]
    await finish_all(seqs)
    assert recorder.max_running == 1
    assert recorder.max_used_blocks <= 4
    assert seqs[1].scheduled_s == seqs[0].finished_s
    assert seqs[2].scheduled_s == seqs[1].finished_s


async def test_decode_step_slows_with_batch_size(make_engine: EngineFactory) -> None:
    def decode_time_per_token(seq: Sequence) -> float:
        assert seq.last_token_s is not None and seq.first_token_s is not None
        return (seq.last_token_s - seq.first_token_s) / (len(seq.output) - 1)

    alone, _ = make_engine(decode_step_ms_per_seq=5.0)
    single = alone.submit("solo", text_prompt(10), max_tokens=10)
    await finish_all([single])

    crowded, _ = make_engine(decode_step_ms_per_seq=5.0)
    batch = [crowded.submit(f"r{i}", text_prompt(10), max_tokens=10) for i in range(6)]
    await finish_all(batch)

    assert decode_time_per_token(single) == pytest.approx(0.015)  # 10 + 5 * 1 ms
    assert decode_time_per_token(batch[0]) == pytest.approx(0.040)  # 10 + 5 * 6 ms


async def test_prefix_cache_hit_skips_prefill(make_engine: EngineFactory) -> None:
    engine, _ = make_engine()
    prompt = text_prompt(100, text="shared system prompt ")
    cold = engine.submit("cold", prompt, max_tokens=2)
    await finish_all([cold])
    warm = engine.submit("warm", prompt, max_tokens=2)
    await finish_all([warm])

    assert cold.cached_tokens == 0
    assert warm.cached_tokens == 96  # 6 full blocks of 16; the partial block is computed
    assert ttft(cold) == pytest.approx(0.100 + 0.010)
    assert ttft(warm) == pytest.approx(0.004 + 0.010)


async def test_prefix_cache_matches_only_the_shared_prefix(make_engine: EngineFactory) -> None:
    engine, _ = make_engine()
    first = engine.submit("a", prompt_from_text("A" * 256 + "B" * 256, 16, 0), max_tokens=1)
    await finish_all([first])
    second = engine.submit("b", prompt_from_text("A" * 256 + "C" * 256, 16, 0), max_tokens=1)
    await finish_all([second])
    assert second.cached_tokens == 64  # the 4 blocks of A's


async def test_a_look_at_the_prefix_cache_changes_nothing(make_engine: EngineFactory) -> None:
    """What an observer of exact state (the benchmark's oracle) may ask: how much of a
    prompt is cached, without touching the cache's eviction order."""
    engine, _ = make_engine(kv_blocks=8, max_model_len=128)  # the cache holds 8 blocks
    a, b = text_prompt(64, text="a"), text_prompt(64, text="b")  # 4 blocks each
    await finish_all([engine.submit("a", a, max_tokens=1)])
    await finish_all([engine.submit("b", b, max_tokens=1)])
    assert engine.cached_prefix_tokens(a) == 63  # the last token is always computed
    assert engine.cached_prefix_tokens(text_prompt(64, text="c")) == 0
    # `a` is the least recently used: a real admission of `c` evicts it, however often
    # it was looked at (a match would have made it recent and evicted `b` instead).
    await finish_all([engine.submit("c", text_prompt(64, text="c"), max_tokens=1)])
    assert engine.cached_prefix_tokens(a) == 0
    assert engine.cached_prefix_tokens(b) == 63


async def test_abort_frees_slot_and_blocks(make_engine: EngineFactory) -> None:
    engine, _ = make_engine(max_num_seqs=1)
    long = engine.submit("long", text_prompt(20), max_tokens=500)
    queued = engine.submit("queued", text_prompt(20), max_tokens=2)
    gone = engine.submit("gone", text_prompt(20), max_tokens=2)
    await long.wait_for_output(0)
    assert engine.num_running == 1 and engine.num_waiting == 2

    engine.abort(gone)  # still waiting: leaves the queue
    assert engine.num_waiting == 1
    engine.abort(long)  # running: frees its slot and blocks at once
    assert engine.num_running == 0 and engine.kv_used_blocks == 0

    await finish_all([queued])
    assert long.finish_reason is FinishReason.ABORT
    assert gone.finish_reason is FinishReason.ABORT
    assert queued.finish_reason is FinishReason.LENGTH
    assert len(long.output) < 500


async def test_kv_pressure_preempts_the_newest_and_recomputes(make_engine: EngineFactory) -> None:
    # Two sequences of 4 + 12 tokens need 4 blocks of 4 each; the pool has 6.
    engine, recorder = make_engine(block_size=4, kv_blocks=6, max_model_len=24)
    seqs = [engine.submit(f"r{i}", text_prompt(4, str(i), 4), max_tokens=12) for i in range(2)]
    await finish_all(seqs)
    assert recorder.preemptions >= 1
    assert seqs[1].num_preemptions >= 1 and seqs[0].num_preemptions == 0
    assert all(len(s.output) == 12 for s in seqs)
    assert recorder.max_used_blocks <= 6


async def test_full_queue_is_refused(make_engine: EngineFactory) -> None:
    engine, _ = make_engine(max_num_seqs=1, max_num_queued_reqs=1)
    running = engine.submit("running", text_prompt(10), max_tokens=50)
    await running.wait_for_output(0)
    engine.submit("waiting", text_prompt(10), max_tokens=1)
    with pytest.raises(QueueFullError, match="queue is full"):
        engine.submit("refused", text_prompt(10), max_tokens=1)


async def test_eos_finishes_with_stop_unless_ignored(make_engine: EngineFactory) -> None:
    engine, _ = make_engine(eos_probability=1.0)
    stops = engine.submit("stops", text_prompt(10), max_tokens=8)
    ignores = engine.submit("ignores", text_prompt(10), max_tokens=8, ignore_eos=True)
    await finish_all([stops, ignores])
    assert (stops.finish_reason, len(stops.output)) == (FinishReason.STOP, 1)
    assert (ignores.finish_reason, len(ignores.output)) == (FinishReason.LENGTH, 8)


async def test_output_is_deterministic_per_prompt_and_seed(make_engine: EngineFactory) -> None:
    engine, _ = make_engine()
    a = engine.submit("a", prompt_from_text("same prompt", 16, 7), max_tokens=6)
    b = engine.submit("b", prompt_from_text("same prompt", 16, 7), max_tokens=6)
    c = engine.submit("c", prompt_from_text("same prompt", 16, 8), max_tokens=6)
    await finish_all([a, b, c])
    assert a.output == b.output
    assert a.output != c.output


async def test_slow_factor_stretches_steps(make_engine: EngineFactory) -> None:
    engine, _ = make_engine()
    engine.slow_factor = 3.0
    seq = engine.submit("slow", text_prompt(100), max_tokens=2)
    await finish_all([seq])
    assert ttft(seq) == pytest.approx(3 * 0.110)


def test_config_refuses_a_context_that_cannot_fit() -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        SimConfig(kv_blocks=4, block_size=16, max_model_len=100)


@pytest.mark.parametrize("field", ["decode_step_ms", "prefill_tokens_per_s", "slow_factor",
                                   "error_rate"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_config_refuses_a_number_that_is_not_finite(field: str, value: float) -> None:
    # NaN passed every bound (`globalpool sim --decode-step-ms nan` served)
    with pytest.raises(ValueError, match=f"{field}: must be a finite number"):
        settings: dict[str, Any] = {field: value}
        SimConfig(**settings)
