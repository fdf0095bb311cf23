"""An engine's recent performance (worker.schema.Performance) from two samples of its
/metrics (worker.engine_metrics): mean latencies and token rates of the requests that
finished in between, and `PerformanceTracker`, which holds each figure through short lulls.

Pure arithmetic on the samples' totals; every figure is kept within the heartbeat's limits
(worker.schema, MAX_*) or is None, never a made-up number.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from worker.engine_metrics import (
    DECODE_TIME,
    E2E,
    GENERATION_TOKENS_COUNTER,
    GENERATION_TOKENS_HIST,
    ITL,
    PREFILL_TIME,
    PREFIX_CACHE_HITS,
    PROMPT_TOKENS_COUNTER,
    PROMPT_TOKENS_HIST,
    TTFT,
    MetricsSample,
    within,
)
from worker.schema import MAX_LATENCY_MS, MAX_TOKENS_PER_S, Performance


def performance_between(before: MetricsSample, after: MetricsSample) -> Performance:
    """Mean performance of the requests that finished between two samples.

    A field is None when no request contributed to it in that interval, or when a counter
    went backwards (the engine restarted), so that idle time never reads as "fast".
    """
    delta = _Delta(before.totals, after.totals)
    if delta.reset:
        return Performance()
    prompt_tokens = computed_tokens(delta.of(f"{PROMPT_TOKENS_HIST}_sum", PROMPT_TOKENS_COUNTER),
                                    delta.of(PREFIX_CACHE_HITS))
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
        ttft_ms=within(delta.mean_ms(TTFT), MAX_LATENCY_MS),
        itl_ms=within(delta.mean_ms(ITL), MAX_LATENCY_MS),
        e2e_ms=within(delta.mean_ms(E2E), MAX_LATENCY_MS),
        prefill_tokens_per_s=within(_rate(prompt_tokens, prefill_busy_s(
            delta.of(f"{PREFILL_TIME}_sum"), delta.of(f"{PREFILL_TIME}_count"),
            decode_tokens_per_s)), MAX_TOKENS_PER_S),
        decode_tokens_per_s=within(decode_tokens_per_s, MAX_TOKENS_PER_S),
    )


# Of the prompt tokens, at least this share counts as computed: the cache-hit counter
# advances as requests are scheduled and the prompt-token histogram as they finish, so in
# one interval the hits may belong to requests that have not finished yet.
MIN_COMPUTED_SHARE = 0.05


def computed_tokens(prompt_tokens: float, cache_hit_tokens: float) -> float:
    """The prompt tokens an engine actually prefilled: those not in its prefix cache.

    A prompt found in the cache costs only its uncached part, and the router prices
    prefill by the uncached part (router.policy.predicted_ttft), so the rate must be
    computed tokens per second: with whole prompts over the prefill time, a fleet of long
    shared system prompts read as several times its engines' true rate (measured on the
    benchmark's prefix-heavy scenario: it cost 10 points of SLO attainment on the twin).
    """
    if cache_hit_tokens <= 0:
        return prompt_tokens
    return max(prompt_tokens - cache_hit_tokens, MIN_COMPUTED_SHARE * prompt_tokens)


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


# The prefill rate is the engine's, not the moment's: each interval's estimate moves it by
# this share (in log space: its errors are ratios). One interval's few prefill phases are
# noisy (a step prefills every prompt admitted with it, so one request's phase holds the
# others' prompts too): on the benchmark's prefix-heavy engines (50,000 tokens/s) single
# intervals read 14,000-79,000.
PREFILL_RATE_WEIGHT = 0.25


def smoothed_rate(previous: float | None, fresh: float) -> float:
    """`fresh` folded into the `previous` estimate of the prefill rate (PREFILL_RATE_WEIGHT)."""
    if previous is None or previous <= 0 or fresh <= 0:
        return fresh
    return math.exp((1 - PREFILL_RATE_WEIGHT) * math.log(previous)
                    + PREFILL_RATE_WEIGHT * math.log(fresh))


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
                if name == "prefill_tokens_per_s":
                    value = smoothed_rate(self._last.get(name), value)
                self._last[name], self._age[name] = value, 0
            elif name in self._last:
                self._age[name] += 1
                if self._age[name] > self._hold:
                    del self._last[name], self._age[name]
            values[name] = self._last.get(name)
        return Performance(**values)
