"""The simulator's settings: what the simulated GPU can hold and how fast it runs.

One frozen `SimConfig` per server. Its defaults describe a mid-sized model on one GPU
(tens of milliseconds per decode step, a few thousand KV blocks); tests shrink or speed
it up. Invalid combinations raise `ValueError` naming the field, because a simulator that
silently can never admit a request would look like a router bug.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

SIM_VERSION = "sim-0.1.0"


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Capacity, speed and API settings of one simulated vLLM server.

    Time per engine step (seconds) =
        (prefill tokens computed in the step / prefill_tokens_per_s
         + (decode_step_ms + decode_step_ms_per_seq * running sequences) / 1000)
        * slow_factor
    """

    served_model_names: tuple[str, ...] = ("tiny-llama",)
    max_num_seqs: int = 64
    kv_blocks: int = 2048
    block_size: int = 16
    prefill_tokens_per_s: float = 10_000.0
    decode_step_ms: float = 10.0
    decode_step_ms_per_seq: float = 0.2
    max_num_queued_reqs: int | None = None
    """Waiting requests beyond this are refused with 503 (vLLM's --max-num-queued-reqs)."""
    max_model_len: int = 4096
    default_max_tokens: int = 32
    """Completion length when a request names neither max_tokens nor max_completion_tokens
    (capped so that prompt + completion fit in max_model_len)."""
    eos_probability: float = 0.0
    """Chance per generated token that the 'model' emits EOS (finish_reason "stop").
    0 means every request runs to its max_tokens, which keeps benchmarks repeatable."""
    enable_prefix_caching: bool = True
    seed: int = 0
    legacy_metrics: bool = False
    """Emit vllm:gpu_cache_usage_perc (vLLM < 0.10) instead of vllm:kv_cache_usage_perc."""
    error_rate: float = 0.0
    """Initial value of the `error_rate` fault knob."""
    slow_factor: float = 1.0
    """Initial value of the `slow_factor` fault knob."""
    responses_store_max: int = 10_000
    """Responses API objects kept in memory for GET, cancel and previous_response_id (the
    newest; vLLM with VLLM_ENABLE_RESPONSES_API_STORE=1 keeps all). 0: none, as vLLM by
    default: `store` is ignored and `background` refused."""

    def __post_init__(self) -> None:
        problems = list(self._problems())
        if problems:
            raise ValueError("invalid simulator config: " + "; ".join(problems))

    def _problems(self) -> list[str]:
        found: list[str] = []
        # (NaN passes every comparison below; inf makes a step or a rate endless)
        found += [f"{field.name}: must be a finite number" for field in fields(self)
                  if isinstance(getattr(self, field.name), float)
                  and not math.isfinite(getattr(self, field.name))]
        if not self.served_model_names or any(not n for n in self.served_model_names):
            found.append("served_model_names: needs at least one non-empty name")
        for name in ("max_num_seqs", "kv_blocks", "block_size", "max_model_len"):
            if getattr(self, name) < 1:
                found.append(f"{name}: must be >= 1")
        if self.prefill_tokens_per_s <= 0:
            found.append("prefill_tokens_per_s: must be > 0")
        if self.decode_step_ms < 0 or self.decode_step_ms_per_seq < 0:
            found.append("decode_step_ms, decode_step_ms_per_seq: must be >= 0")
        if self.max_num_queued_reqs is not None and self.max_num_queued_reqs < 0:
            found.append("max_num_queued_reqs: must be >= 0")
        if self.default_max_tokens < 1:
            found.append("default_max_tokens: must be >= 1")
        if not 0.0 <= self.eos_probability <= 1.0:
            found.append("eos_probability: must be between 0 and 1")
        if not 0.0 <= self.error_rate <= 1.0:
            found.append("error_rate: must be between 0 and 1")
        if self.slow_factor <= 0:
            found.append("slow_factor: must be > 0")
        if self.responses_store_max < 0:
            found.append("responses_store_max: must be >= 0")
        # vLLM refuses to start when one sequence of max_model_len cannot fit in the KV
        # cache; without this check a long request could wait forever in the queue.
        if self.max_model_len > self.kv_blocks * self.block_size:
            found.append(
                f"max_model_len: {self.max_model_len} tokens do not fit in the KV cache "
                f"({self.kv_blocks} blocks x {self.block_size} tokens); "
                "raise kv_blocks or lower max_model_len"
            )
        return found

    @property
    def model_name(self) -> str:
        """The name in metric labels: vLLM labels metrics with the first served name."""
        return self.served_model_names[0]
