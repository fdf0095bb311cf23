"""The simulator's /metrics: vLLM 0.32's metric names, label sets and buckets.

A worker agent that scrapes the simulator must not be able to tell it from vLLM by the
metric names it parses (tests/fixtures/vllm-0.32-cpu-metrics.txt is the reference). Each
app owns its own `CollectorRegistry`, so many simulators can share one process.

Counters and histograms are updated from engine events (`EngineObserver`); the gauges
(running, waiting, KV usage) are read from the engine at scrape time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from lab.sim.config import SimConfig
from lab.sim.sequence import FinishReason, Sequence

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Bucket boundaries copied from vLLM 0.32 (see the capture).
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
_REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def token_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM's 1-2-5 series up to max_model_len (build_1_2_5_buckets)."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_model_len:
                return tuple(buckets)
            buckets.append(float(value))
        exponent += 1


class EngineState(Protocol):
    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def kv_usage(self) -> float: ...


def cache_config_labels(config: SimConfig) -> dict[str, str]:
    """vllm:cache_config_info's labels: the same names as vLLM 0.32, simulator values."""
    kv_tokens = config.kv_blocks * config.block_size
    values = {
        "_block_size_resolved": "True",
        "block_size": str(config.block_size),
        "cache_dtype": "auto",
        "cache_hit_alignment_tokens": "None",
        "effective_attention_block_size": str(config.block_size),
        "enable_mamba_shared_prefix_checkpoint": "False",
        "enable_prefix_caching": str(config.enable_prefix_caching),
        "gpu_memory_utilization": "0.9",
        "hash_block_size": "None",
        "is_attention_free": "False",
        "kv_cache_dtype_skip_layers": "[]",
        "kv_cache_layout": "None",
        "kv_cache_max_concurrency": str(round(kv_tokens / config.max_model_len, 2)),
        "kv_cache_memory_bytes": "None",
        "kv_cache_size_tokens": str(kv_tokens),
        "kv_offloading_backend": "native",
        "kv_offloading_size": "None",
        "kv_sharing_fast_prefill": "False",
        "mamba_block_size": "None",
        "mamba_cache_dtype": "auto",
        "mamba_cache_mode": "none",
        "mamba_page_size_padded": "None",
        "mamba_ssm_cache_dtype": "auto",
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(config.kv_blocks),
        "num_gpu_blocks_override": "None",
        "prefix_cache_retention_interval": "0",
        "prefix_caching_hash_algo": "sha256",
        "prefix_match_unit": "None",
        "replayssm_buffer_len": "16",
        "skip_page_size_padded": "None",
        "sliding_window": "None",
        "swa_bounded_replay": "True",
        "use_kda_recoverssm": "False",
        "use_replayssm": "False",
        "user_specified_block_size": "True",
    }
    return {"engine": "0", **values}


class _EngineGauges(Collector):
    """Gauges read from the engine when scraped, so they are never stale."""

    def __init__(self, config: SimConfig, engine: EngineState) -> None:
        self._engine = engine
        self._model = config.model_name
        self._legacy = config.legacy_metrics
        self._cache_labels = cache_config_labels(config)

    def collect(self) -> Iterator[Metric]:
        labels = ["engine", "model_name"]
        values = ["0", self._model]
        running = GaugeMetricFamily(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            labels=labels,
        )
        running.add_metric(values, self._engine.num_running)
        yield running
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            labels=labels,
        )
        waiting.add_metric(values, self._engine.num_waiting)
        yield waiting
        by_reason = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason.",
            labels=[*labels, "reason"],
        )
        by_reason.add_metric([*values, "capacity"], self._engine.num_waiting)
        by_reason.add_metric([*values, "deferred"], 0)
        yield by_reason
        if self._legacy:
            kv_name, kv_help = (
                "vllm:gpu_cache_usage_perc",
                "GPU KV-cache usage. 1 means 100 percent usage.",
            )
        else:
            kv_name, kv_help = (
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
            )
        kv = GaugeMetricFamily(kv_name, kv_help, labels=labels)
        kv.add_metric(values, self._engine.kv_usage)
        yield kv
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=list(self._cache_labels),
        )
        info.add_metric(list(self._cache_labels.values()), 1.0)
        yield info


class SimMetrics:
    """vLLM's engine metrics for one simulator; implements `EngineObserver`."""

    def __init__(self, config: SimConfig) -> None:
        self.registry = CollectorRegistry()
        self._config = config
        names = ["engine", "model_name"]
        values = {"engine": "0", "model_name": config.model_name}

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=self.registry)

        self._prefix_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        ).labels(**values)
        self._prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        ).labels(**values)
        self._preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        ).labels(**values)
        self._prompt_tokens = counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed."
        ).labels(**values)
        self._generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        ).labels(**values)
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*names, "finished_reason"],
            registry=self.registry,
        )
        self._success = {
            reason: success.labels(finished_reason=reason.value, **values)
            for reason in FinishReason
        }
        self._rejections = Counter(
            "vllm:admission_rejections",
            "Number of admission attempts rejected by a queue limit, by reason.",
            ["model_name", "reason"],
            registry=self.registry,
        ).labels(model_name=config.model_name, reason="max_num_queued_reqs")

        token_bounds = token_buckets(config.max_model_len)
        self._req_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_bounds
        ).labels(**values)
        self._req_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", token_bounds
        ).labels(**values)
        self._iteration_tokens = histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            tuple(float(b) for b in _ITERATION_TOKEN_BUCKETS),
        ).labels(**values)
        self._ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            _TTFT_BUCKETS,
        ).labels(**values)
        self._itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            _ITL_BUCKETS,
        ).labels(**values)
        self._tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            _ITL_BUCKETS,
        ).labels(**values)
        phases = {
            "e2e": (
                "vllm:e2e_request_latency_seconds",
                "Histogram of e2e request latency in seconds.",
            ),
            "queue": (
                "vllm:request_queue_time_seconds",
                "Histogram of time spent in WAITING phase for request.",
            ),
            "inference": (
                "vllm:request_inference_time_seconds",
                "Histogram of time spent in RUNNING phase for request.",
            ),
            "prefill": (
                "vllm:request_prefill_time_seconds",
                "Histogram of time spent in PREFILL phase for request.",
            ),
            "decode": (
                "vllm:request_decode_time_seconds",
                "Histogram of time spent in DECODE phase for request.",
            ),
        }
        self._phase = {
            key: histogram(name, doc, _REQUEST_LATENCY_BUCKETS).labels(**values)
            for key, (name, doc) in phases.items()
        }

    def watch(self, engine: EngineState) -> None:
        """Expose the engine's gauges; call once, after the engine exists."""
        self.registry.register(_EngineGauges(self._config, engine))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # EngineObserver

    def on_admitted(self, seq: Sequence, queried_tokens: int, hit_tokens: int) -> None:
        if self._config.enable_prefix_caching:
            self._prefix_queries.inc(queried_tokens)
            self._prefix_hits.inc(hit_tokens)

    def on_first_token(self, seq: Sequence) -> None:
        self._prompt_tokens.inc(seq.prompt.num_tokens)
        if seq.first_token_s is not None:
            self._ttft.observe(seq.first_token_s - seq.arrival_s)

    def on_decode_token(self, inter_token_s: float) -> None:
        self._itl.observe(inter_token_s)

    def on_step(self, scheduled_tokens: int, generated_tokens: int) -> None:
        self._generation_tokens.inc(generated_tokens)
        self._iteration_tokens.observe(scheduled_tokens)

    def on_preempted(self, seq: Sequence) -> None:
        self._preemptions.inc()

    def on_rejected(self) -> None:
        self._rejections.inc()

    def on_finished(self, seq: Sequence) -> None:
        reason = seq.finish_reason or FinishReason.ERROR
        self._success[reason].inc()
        if reason not in (FinishReason.STOP, FinishReason.LENGTH):
            return
        if (
            seq.scheduled_s is None
            or seq.first_token_s is None
            or seq.last_token_s is None
            or seq.finished_s is None
        ):
            return
        generated = len(seq.output)
        decode_s = seq.last_token_s - seq.first_token_s
        self._phase["e2e"].observe(seq.finished_s - seq.arrival_s)
        self._phase["queue"].observe(seq.scheduled_s - seq.arrival_s)
        self._phase["inference"].observe(seq.last_token_s - seq.scheduled_s)
        self._phase["prefill"].observe(seq.first_token_s - seq.scheduled_s)
        self._phase["decode"].observe(decode_s)
        self._req_prompt_tokens.observe(seq.prompt.num_tokens)
        self._req_generation_tokens.observe(generated)
        if generated > 1:
            self._tpot.observe(decode_s / (generated - 1))
