"""How many requests per second one simulated worker serves at saturation, for a workload.

The scenario's demand is a multiple of capacity, so capacity must be measured the way the
fleet will serve: the simulator's own engine model (lab.sim.engine, the code every
`globalpool sim` runs) in virtual time, fed a sample of the scenario's requests all at
once, so that the batch is always full and the queue never empty. Capacity is the
completion rate between the 10th and the 90th percentile of completions (no ramp-up, no
tail). The prefix cache is on, and one worker sees the whole mix, as it would when
requests are spread at random; routing that keeps prefixes together does better.

Deterministic: virtual time, no randomness, the same sample gives the same number.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from lab.bench.scenario import EngineSpec
from lab.bench.trace import PromptBuilder, TraceRequest
from lab.sim.clock import VirtualClock
from lab.sim.config import SimConfig
from lab.sim.engine import Engine
from lab.sim.tokens import prompt_from_text


def sim_config(engine: EngineSpec, model: str) -> SimConfig:
    return SimConfig(
        served_model_names=(model,), max_num_seqs=engine.max_num_seqs,
        kv_blocks=engine.kv_blocks, block_size=engine.block_size,
        prefill_tokens_per_s=engine.prefill_tokens_per_s,
        decode_step_ms=engine.decode_step_ms,
        decode_step_ms_per_seq=engine.decode_step_ms_per_seq,
        max_model_len=engine.max_model_len,
    )


async def _saturate(config: SimConfig, requests: Sequence[TraceRequest], model: str
                    ) -> list[float]:
    clock = VirtualClock()
    engine = Engine(config, clock)
    builder = PromptBuilder(model)
    sequences = []
    for request in requests:
        text = "\n".join(m["content"] for m in builder.messages(request))
        prompt = prompt_from_text(text, config.block_size, config.seed)
        sequences.append(engine.submit(f"calibrate-{request.index}", prompt,
                                       request.max_tokens, ignore_eos=True))
    running = asyncio.create_task(engine.run())
    try:
        await asyncio.gather(*(seq.wait_finished() for seq in sequences))
    finally:
        running.cancel()
    return sorted(seq.finished_s for seq in sequences if seq.finished_s is not None)


def worker_capacity_rps(engine: EngineSpec, requests: Sequence[TraceRequest],
                        model: str = "tiny-llama") -> float:
    """Requests per second one worker completes when it is never short of work."""
    if len(requests) < 20:
        raise ValueError("need at least 20 requests to measure capacity")
    config = sim_config(engine, model)
    loop = asyncio.new_event_loop()
    try:
        finished = loop.run_until_complete(_saturate(config, requests, model))
    finally:
        loop.close()
    low, high = int(0.1 * len(finished)), int(0.9 * len(finished))
    span_s = finished[high] - finished[low]
    return (high - low) / span_s if span_s > 0 else float("inf")
