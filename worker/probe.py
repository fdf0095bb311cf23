"""Read one vLLM server's /health, /metrics, /v1/models and /version.

Parsing is pure (text or JSON in, values out) so that it is tested against real vLLM
captures; `EngineProber` only adds HTTP. vLLM renames metrics between versions, so every
value records which metric it came from, and a value the engine does not expose is None,
never a silent 0. Every number read is kept within the heartbeat's limits (worker.schema,
MAX_*): a NaN or an infinity is legal Prometheus text, and a heartbeat never carries one.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from worker.schema import (
    MAX_BLOCK_SIZE_TOKENS,
    MAX_KV_BLOCKS,
    MAX_LATENCY_MS,
    MAX_NAME_CHARS,
    MAX_NAMES,
    MAX_SEQS,
    MAX_TOKENS_PER_S,
    Performance,
)

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


_Parsed = TypeVar("_Parsed")


class MetricsFormatError(ValueError):
    """The /metrics body is not Prometheus text, or lacks the request-count gauges."""


@dataclass(frozen=True)
class MetricsSample:
    """One scrape of vLLM's /metrics, summed over every engine and model label set.

    `totals` maps sample names (`..._sum`, `..._count`, `..._total`) to cumulative values;
    performance comes from the difference of two samples (`performance_between`).
    """

    running: int
    waiting: int
    kv_cache_usage: float | None
    kv_usage_metric: str | None
    kv_blocks_total: int | None
    block_size_tokens: int | None
    totals: Mapping[str, float] = field(default_factory=dict)
    metric_names: tuple[str, ...] = ()

    @property
    def in_flight(self) -> int:
        return self.running + self.waiting


def parse_metrics(text: str) -> MetricsSample:
    """Parse vLLM's Prometheus text. Raises MetricsFormatError if it is not usable."""
    totals: dict[str, float] = {}
    kv_values: dict[str, list[float]] = {}
    cache_labels: list[Mapping[str, str]] = []
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                name, value = sample.name, float(sample.value)
                if not name.startswith("vllm:") or not math.isfinite(value):
                    continue  # NaN, +Inf, -Inf: no number to report (as if not exposed)
                if name == CACHE_CONFIG:
                    cache_labels.append(sample.labels)
                elif name in KV_USAGE_METRICS:
                    kv_values.setdefault(name, []).append(value)
                elif not name.endswith(("_bucket", "_created")):
                    totals[name] = totals.get(name, 0.0) + value
    except ValueError as exc:
        raise MetricsFormatError(f"not Prometheus text: {exc}") from None
    if RUNNING not in totals or WAITING not in totals:
        raise MetricsFormatError(f"{RUNNING} or {WAITING} missing; is this a vLLM server?")
    kv_metric = next((name for name in KV_USAGE_METRICS if name in kv_values), None)
    kv_usage: float | None = None
    if kv_metric is not None:
        # A fraction per engine: several engines average, they do not add up.
        values = kv_values[kv_metric]
        kv_usage = _within(sum(values) / len(values), 1.0)
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
    )


def _seqs(total: float) -> int:
    """A count of sequences from a sum of samples, within the schema's limit (a sum of
    huge samples can overflow to inf, which `round` refuses)."""
    return MAX_SEQS if not total < MAX_SEQS else max(0, round(total))


def _within(value: float | None, high: float) -> float | None:
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


def performance_between(before: MetricsSample, after: MetricsSample) -> Performance:
    """Mean performance of the requests that finished between two samples.

    A field is None when no request contributed to it in that interval, or when a counter
    went backwards (the engine restarted), so that idle time never reads as "fast".
    """
    delta = _Delta(before.totals, after.totals)
    if delta.reset:
        return Performance()
    prompt_tokens = delta.of(f"{PROMPT_TOKENS_HIST}_sum", PROMPT_TOKENS_COUNTER)
    # The first generated token belongs to prefill; decode time covers the rest.
    decode_tokens: float | None
    if f"{GENERATION_TOKENS_HIST}_sum" in after.totals:
        decode_tokens = delta.of(f"{GENERATION_TOKENS_HIST}_sum") - delta.of(
            f"{GENERATION_TOKENS_HIST}_count"
        )
    else:
        decode_tokens = delta.of(GENERATION_TOKENS_COUNTER)
    decode_tokens_per_s = _rate(decode_tokens, delta.of(f"{DECODE_TIME}_sum"))
    # Sums of finite samples can still overflow (inf - inf is NaN): each figure is kept
    # within the schema's limits, or None.
    return Performance(
        ttft_ms=_within(delta.mean_ms(TTFT), MAX_LATENCY_MS),
        itl_ms=_within(delta.mean_ms(ITL), MAX_LATENCY_MS),
        e2e_ms=_within(delta.mean_ms(E2E), MAX_LATENCY_MS),
        prefill_tokens_per_s=_within(_rate(prompt_tokens, prefill_busy_s(
            delta.of(f"{PREFILL_TIME}_sum"), delta.of(f"{PREFILL_TIME}_count"),
            decode_tokens_per_s)), MAX_TOKENS_PER_S),
        decode_tokens_per_s=_within(decode_tokens_per_s, MAX_TOKENS_PER_S),
    )


# The decode-step share taken out of the prefill phase leaves at least this much of it.
MIN_PREFILL_SHARE = 0.2


def prefill_busy_s(prefill_s: float, requests: float,
                   decode_tokens_per_s: float | None) -> float:
    """The part of `requests`' prefill phases (`prefill_s` in all) spent on their prompts.

    An engine's prefill phase of a request (scheduled -> first token) is one engine step
    that also advances every running sequence by a token: prompt tokens / rate plus a
    decode step, whose length is the per-sequence decode time (1 / decode tokens per s).
    Without taking that step out, prompt tokens / prefill time reads a short prompt as a
    slow engine (a 500-token prompt on a 10,000 tokens/s engine in a 100 ms decode step
    read as 3,300 tokens/s), and the estimate follows the recent prompt sizes instead of
    the engine. At least MIN_PREFILL_SHARE of the phase is kept.
    """
    if decode_tokens_per_s is None or requests <= 0:
        return prefill_s
    return max(prefill_s - requests / decode_tokens_per_s, MIN_PREFILL_SHARE * prefill_s)


def _rate(tokens: float | None, seconds: float) -> float | None:
    if tokens is None or tokens <= 0 or seconds <= 0:
        return None
    return tokens / seconds


class _Delta:
    def __init__(self, before: Mapping[str, float], after: Mapping[str, float]) -> None:
        self._before = before
        self._after = after
        self.reset = any(after.get(name, value) < value for name, value in before.items()
                         if name.endswith(("_count", "_sum", "_total")))

    def of(self, *names: str) -> float:
        """Increase of the first of `names` the engine exposes; 0 if none."""
        for name in names:
            if name in self._after:
                return self._after[name] - self._before.get(name, self._after[name])
        return 0.0

    def mean_ms(self, families: tuple[str, ...]) -> float | None:
        for family in families:
            if f"{family}_count" in self._after:
                count = self.of(f"{family}_count")
                return 1000.0 * max(0.0, self.of(f"{family}_sum")) / count if count > 0 else None
        return None


class PerformanceTracker:
    """Turns successive samples into Performance, holding each field through short lulls.

    A quiet interval yields None from `performance_between`; repeating the last value for
    `hold_intervals` updates keeps routers from seeing a worker flap between known and
    unknown speed between two bursts of traffic.
    """

    _FIELDS = ("ttft_ms", "itl_ms", "e2e_ms", "prefill_tokens_per_s", "decode_tokens_per_s")

    def __init__(self, hold_intervals: int = 4) -> None:
        self._hold = hold_intervals
        self._previous: MetricsSample | None = None
        self._last: dict[str, float] = {}
        self._age: dict[str, int] = {}

    def update(self, sample: MetricsSample) -> Performance:
        fresh = (performance_between(self._previous, sample) if self._previous is not None
                 else Performance())
        self._previous = sample
        values: dict[str, Any] = {}
        for name in self._FIELDS:
            value = getattr(fresh, name)
            if value is not None:
                self._last[name], self._age[name] = value, 0
            elif name in self._last:
                self._age[name] += 1
                if self._age[name] > self._hold:
                    del self._last[name], self._age[name]
            values[name] = self._last.get(name)
        return Performance(**values)


@dataclass(frozen=True)
class ServedModels:
    """Base models and LoRA adapters listed by /v1/models."""

    models: tuple[str, ...]
    lora_adapters: tuple[str, ...]


def parse_models(payload: Any) -> ServedModels:
    """Split an OpenAI /v1/models answer into base models and LoRA adapters.

    vLLM sets `parent` on adapters only. `root` is not used: with --served-model-name a
    base model's `root` (its path) differs from its `id` too.
    """
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list):
        raise ValueError("expected an object with a 'data' list")
    models: list[str] = []
    adapters: list[str] = []
    for entry in data:
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
            raise ValueError("every entry needs a string 'id'")
        if not 1 <= len(entry["id"]) <= MAX_NAME_CHARS:
            raise ValueError(f"a model id of {len(entry['id'])} characters (a heartbeat "
                             f"carries 1 to {MAX_NAME_CHARS})")
        (adapters if entry.get("parent") else models).append(entry["id"])
    if max(len(models), len(adapters)) > MAX_NAMES:
        raise ValueError(f"{len(models)} models and {len(adapters)} adapters (a heartbeat "
                         f"carries at most {MAX_NAMES} of each)")
    return ServedModels(tuple(models), tuple(adapters))


@dataclass(frozen=True)
class EngineVersion:
    """/version: vLLM answers {"version": "0.32.0"}; globalpool's simulator adds
    "simulator": true, so that its heartbeats never pass for a real vLLM."""

    version: str
    simulator: bool = False


def parse_version(payload: Any) -> EngineVersion:
    version = payload.get("version") if isinstance(payload, dict) else None
    if not isinstance(version, str) or not 1 <= len(version) <= MAX_NAME_CHARS:
        raise ValueError(f"expected {{'version': '<string of 1 to {MAX_NAME_CHARS} "
                         "characters>'}")
    return EngineVersion(version, simulator=payload.get("simulator") is True)


@dataclass(frozen=True)
class ProbeResult:
    """What one probe saw. A part that failed is None and its reason is in `errors`."""

    health_ok: bool
    metrics: MetricsSample | None
    models: ServedModels | None
    version: EngineVersion | None
    errors: tuple[str, ...] = ()

    @property
    def engine_ok(self) -> bool:
        """Healthy and measurable: what `ready` requires of the engine."""
        return self.health_ok and self.metrics is not None


def open_engine_session(timeout_s: float = 1.0) -> aiohttp.ClientSession:
    """The one HTTP session to the engine. `timeout_s` bounds each request, connect included,
    so that a hung engine delays a heartbeat by at most that much."""
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=min(timeout_s, 0.5))
    return aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=8), raise_for_status=False
    )


class EngineProber:
    """Probes one engine over a caller-owned session; caches /version while /health answers."""

    def __init__(self, session: aiohttp.ClientSession, engine_url: str) -> None:
        self._session = session
        self._base = engine_url.rstrip("/")
        self._version: EngineVersion | None = None

    async def probe(self) -> ProbeResult:
        """Read the four endpoints concurrently. Never raises for engine failures."""
        errors: list[str] = []
        health, metrics_text, models_json, version_json = await asyncio.gather(
            self._get("/health", errors, want="status"),
            self._get("/metrics", errors, want="text"),
            self._get("/v1/models", errors, want="json"),
            self._get("/version", errors, want="json") if self._version is None else _none(),
        )
        metrics = _guard(parse_metrics, metrics_text, "/metrics", errors)
        models = _guard(parse_models, models_json, "/v1/models", errors)
        if self._version is None:
            self._version = _guard(parse_version, version_json, "/version", errors)
        result = ProbeResult(
            health_ok=health is not None,
            metrics=metrics,
            models=models,
            version=self._version,
            errors=tuple(errors),
        )
        if not result.health_ok:
            # The engine that answers next may be another one (restarted, maybe upgraded):
            # ask it for its version again.
            self._version = None
        return result

    async def _get(self, path: str, errors: list[str], *, want: str) -> Any:
        try:
            async with self._session.get(self._base + path) as response:
                if response.status != 200:
                    errors.append(f"{path}: HTTP {response.status}")
                    return None
                if want == "json":
                    return await response.json(content_type=None)
                if want == "text":
                    return await response.text()
                return True
        except TimeoutError:
            errors.append(f"{path}: timed out")
        except (aiohttp.ClientError, ValueError) as exc:
            errors.append(f"{path}: {type(exc).__name__}: {exc}")
        return None


async def _none() -> None:
    return None


def _guard(
    parse: Callable[[Any], _Parsed], payload: Any, path: str, errors: list[str]
) -> _Parsed | None:
    """Parse an answer that arrived; a malformed one becomes an error, not an exception."""
    if payload is None:
        return None
    try:
        return parse(payload)
    except ValueError as exc:
        errors.append(f"{path}: {exc}")
        return None
