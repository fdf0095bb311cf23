"""vLLM's Prometheus /metrics text -> `MetricsSample`: the engine's load, its KV cache, and
the cumulative totals that its performance is computed from (worker.engine_performance).

Parsing is pure (text in, values out) so that it is tested against real vLLM captures.
vLLM renames metrics between versions, so every value records which metric it came from,
and a value the engine does not expose is None, never a silent 0. Every number read is
kept within the heartbeat's limits (worker.schema, MAX_*): a NaN or an infinity is legal
Prometheus text, and a heartbeat never carries one. Nor a negative count or fraction: a
negative KV usage is ignored like a NaN, and a negative request count makes the body
unusable (clamped to 0 it would advertise an idle engine whose metrics are broken).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from worker.schema import MAX_BLOCK_SIZE_TOKENS, MAX_KV_BLOCKS, MAX_SEQS

# KV cache usage (a fraction 0..1 despite the name); vLLM 0.10 renamed the gauge.
KV_USAGE_METRICS = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
CACHE_CONFIG = "vllm:cache_config_info"

# Histograms whose sum/count deltas give mean latencies over an interval.
TTFT = ("vllm:time_to_first_token_seconds",)
ITL = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")  # new, old
E2E = ("vllm:e2e_request_latency_seconds",)
PREFILL_TIME = "vllm:request_prefill_time_seconds"
DECODE_TIME = "vllm:request_decode_time_seconds"
# Token counts observed when a request finishes, like the prefill/decode times above, so a
# short interval divides tokens and seconds of the same requests. The running counters
# (`*_tokens_total`) advance during a request and are only the fallback.
PROMPT_TOKENS_HIST = "vllm:request_prompt_tokens"
GENERATION_TOKENS_HIST = "vllm:request_generation_tokens"
PROMPT_TOKENS_COUNTER = "vllm:prompt_tokens_total"
GENERATION_TOKENS_COUNTER = "vllm:generation_tokens_total"
# Prompt tokens found in the prefix cache (counted as requests are scheduled): not
# computed in the prefill phase, so not part of the engine's prefill rate.
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits_total"
# Observed once per engine step (vLLM 0.6 and later): progress (worker.progress).
STEP_COUNT = "vllm:iteration_tokens_total_count"
# The label that tells the engines behind one server apart (vLLM: the data-parallel rank's
# engine index, "0" with one engine), and what is kept of each for worker.progress: its
# requests and what moves as it steps. At most MAX_ENGINES of them; a body naming more is
# judged as one engine.
ENGINE_LABEL = "engine"
_PER_ENGINE = frozenset({RUNNING, WAITING, STEP_COUNT, PROMPT_TOKENS_COUNTER,
                         GENERATION_TOKENS_COUNTER})
MAX_ENGINES = 256


class MetricsFormatError(ValueError):
    """The /metrics body is not Prometheus text, or lacks the request-count gauges."""


@dataclass(frozen=True)
class MetricsSample:
    """One scrape of vLLM's /metrics, summed over every engine and model label set.

    `totals` maps sample names (`..._sum`, `..._count`, `..._total`) to cumulative values;
    performance comes from the difference of two samples
    (worker.engine_performance.performance_between).
    """

    running: int
    waiting: int
    kv_cache_usage: float | None
    kv_usage_metric: str | None
    kv_blocks_total: int | None
    block_size_tokens: int | None
    totals: Mapping[str, float] = field(default_factory=dict)
    metric_names: tuple[str, ...] = ()
    # Per engine behind the server (its ENGINE_LABEL), the totals of what progress is
    # judged by (_PER_ENGINE); empty when the body does not tell its engines apart (no
    # label on some request count, or more than MAX_ENGINES of them).
    engines: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    @property
    def in_flight(self) -> int:
        return self.running + self.waiting

    @property
    def engine_count(self) -> int:
        """Engines behind the server (data parallel: one per `engine` label), at least 1:
        each runs up to `--max-num-seqs` sequences, and the running and waiting counts
        and KV blocks above are their sums."""
        return max(1, len(self.engines))


def parse_metrics(text: str) -> MetricsSample:
    """Parse vLLM's Prometheus text. Raises MetricsFormatError if it is not usable."""
    totals: dict[str, float] = {}
    kv_values: dict[str, list[float]] = {}
    cache_labels: list[Mapping[str, str]] = []
    negative: list[str] = []
    engines: dict[str, dict[str, float]] | None = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                name, value = sample.name, float(sample.value)
                if not name.startswith("vllm:") or not math.isfinite(value):
                    continue  # NaN, +Inf, -Inf: no number to report (as if not exposed)
                if name in (RUNNING, WAITING) and value < 0:
                    negative.append(f"{name} {value:g}")
                elif name == CACHE_CONFIG:
                    cache_labels.append(sample.labels)
                elif name in KV_USAGE_METRICS:
                    if value >= 0:  # a negative fraction is no number either (as NaN)
                        kv_values.setdefault(name, []).append(value)
                elif not name.endswith(("_bucket", "_created")):
                    totals[name] = totals.get(name, 0.0) + value
                    if name in _PER_ENGINE and engines is not None:
                        engines = _per_engine(engines, sample.labels, name, value)
    except ValueError as exc:
        raise MetricsFormatError(f"not Prometheus text: {exc}") from None
    if negative:
        raise MetricsFormatError(f"a negative count of requests: {', '.join(negative[:4])}")
    if RUNNING not in totals or WAITING not in totals:
        raise MetricsFormatError(f"{RUNNING} or {WAITING} missing; is this a vLLM server?")
    kv_metric = next((name for name in KV_USAGE_METRICS if name in kv_values), None)
    kv_usage: float | None = None
    if kv_metric is not None:
        # A fraction per engine: several engines average, they do not add up.
        values = kv_values[kv_metric]
        kv_usage = within(sum(values) / len(values), 1.0)
    blocks, block_size = _cache_config(cache_labels)
    present = set(totals) | set(kv_values) | ({CACHE_CONFIG} if cache_labels else set())
    return MetricsSample(
        running=_seqs(totals[RUNNING]),
        waiting=_seqs(totals[WAITING]),
        kv_cache_usage=kv_usage,
        kv_usage_metric=kv_metric,
        kv_blocks_total=blocks,
        block_size_tokens=block_size,
        totals=totals,
        metric_names=tuple(sorted(_used_names(present))),
        engines=engines if engines and all(
            RUNNING in one and WAITING in one for one in engines.values()) else {},
    )


def _per_engine(engines: dict[str, dict[str, float]], labels: Mapping[str, str], name: str,
                value: float) -> dict[str, dict[str, float]] | None:
    """`engines` with `value` added to its engine's `name`; None once they cannot be told
    apart (a sample without the label, or more than MAX_ENGINES engines)."""
    engine = labels.get(ENGINE_LABEL)
    if engine is None or (engine not in engines and len(engines) >= MAX_ENGINES):
        return None
    totals = engines.setdefault(engine, {})
    totals[name] = totals.get(name, 0.0) + value
    return engines


def _seqs(total: float) -> int:
    """A count of sequences from a sum of samples, within the schema's limit (a sum of
    huge samples can overflow to inf, which `round` refuses)."""
    return MAX_SEQS if not total < MAX_SEQS else max(0, round(total))


def within(value: float | None, high: float) -> float | None:
    """`value` clamped to 0..`high`; None (unknown) when it is NaN or infinite (a sum that
    overflowed, a mean over a vanishing count): no figure rather than a made-up one."""
    if value is None or not math.isfinite(value):
        return None
    return min(high, max(0.0, value))


def _cache_config(labels: list[Mapping[str, str]]) -> tuple[int | None, int | None]:
    """Total GPU KV blocks over engines, and the block size (vLLM writes 'None' if unknown);
    None for values outside the heartbeat's limits."""
    blocks = [_int_label(one, "num_gpu_blocks") for one in labels]
    sizes = [_int_label(one, "block_size") for one in labels]
    known_blocks = [b for b in blocks if b is not None and b >= 0]
    known_sizes = [s for s in sizes if s is not None and 1 <= s <= MAX_BLOCK_SIZE_TOKENS]
    total = sum(known_blocks) if known_blocks else None
    return (total if total is not None and total <= MAX_KV_BLOCKS else None,
            min(known_sizes) if known_sizes else None)


def _int_label(labels: Mapping[str, str], key: str) -> int | None:
    try:
        return int(float(labels[key]))
    except (KeyError, ValueError, OverflowError):  # "None", "nan"; "inf"
        return None


_HISTOGRAMS = (*TTFT, *ITL, *E2E, PREFILL_TIME, DECODE_TIME, PROMPT_TOKENS_HIST,
               GENERATION_TOKENS_HIST)
_PLAIN = (RUNNING, WAITING, CACHE_CONFIG, *KV_USAGE_METRICS, PROMPT_TOKENS_COUNTER,
          GENERATION_TOKENS_COUNTER)


def _used_names(present: set[str]) -> list[str]:
    """The metrics this module reads that the engine actually exposes."""
    return [name for name in _PLAIN if name in present] + [
        name for name in _HISTOGRAMS if f"{name}_sum" in present
    ]
