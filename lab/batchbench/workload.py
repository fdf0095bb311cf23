"""The two workloads: the batch's JSONL file, and the interactive load beside it.

The interactive load is streaming chat from clients in every region of the config (the
router is told each request's origin, `x-globalpool-client-region`, so each region's
clients are served near them as they would be), open loop: requests start on schedule
whether or not earlier ones ended. Its rate is sized from the simulator's model
(lab.batchbench.capacity) to hold `share` of the fleet's slots; the baseline phase
measures the share it really holds.
"""

from __future__ import annotations

import json

from lab.batchbench.capacity import EngineSpeed
from lab.devstack.loadgen import LoadSpec, LoadTarget
from router.config import GlobalConfig

PROMPT_TOKENS_GUESS = 24  # for sizing only; the report uses the tokens the answers count
ENDPOINT = "/v1/chat/completions"


def batch_jsonl(count: int, model: str, max_tokens: int) -> bytes:
    """`count` chat lines, custom_id `line-0` ..., each asking for exactly `max_tokens`
    tokens (`ignore_eos`, as vLLM reads it), as OpenAI's Batch API takes them."""
    rows = [json.dumps({
        "custom_id": f"line-{index}", "method": "POST", "url": ENDPOINT,
        "body": {"model": model, "max_tokens": max_tokens, "ignore_eos": True,
                 "messages": [{"role": "user",
                               "content": f"Summarize document {index} of tonight's batch."}]},
    }, separators=(",", ":")) for index in range(count)]
    return ("\n".join(rows) + "\n").encode()


def fleet_slots(config: GlobalConfig) -> int:
    return sum(spec.simulated.workers * spec.simulated.max_num_seqs
               for spec in config.regions.values())


def sized_rate_per_s(config: GlobalConfig, share: float, max_tokens: int) -> float:
    """Requests/s that hold `share` of the fleet's slots, by Little's law, each request
    taking as long as the simulator makes it with `share` of a worker's slots busy."""
    held = 0.0
    per_request_s: list[float] = []
    for spec in config.regions.values():
        pool = spec.simulated
        if not pool.workers:
            continue
        speed = EngineSpeed.of(pool)
        held += share * pool.workers * pool.max_num_seqs
        per_request_s += [speed.request_s(share * pool.max_num_seqs, PROMPT_TOKENS_GUESS,
                                          max_tokens)] * pool.workers
    if not per_request_s:
        raise ValueError("the config simulates no workers")
    return held / (sum(per_request_s) / len(per_request_s))


def interactive_spec(router_url: str, config: GlobalConfig, *, rate_per_s: float,
                     duration_s: float, max_tokens: int, request_timeout_s: float,
                     seed: int) -> LoadSpec:
    """The interactive load: `rate_per_s` in all, clients of every region in turn."""
    targets = [LoadTarget(router_url, origin_region=region, send_origin=True)
               for region, spec in config.regions.items() if spec.simulated.workers]
    return LoadSpec(
        targets=targets, duration_s=duration_s, rate_per_s=rate_per_s,
        max_requests=int(rate_per_s * duration_s) + 10, max_in_flight=2000,
        request_timeout_s=request_timeout_s, model=config.models[0], max_tokens=max_tokens,
        seed=seed)
