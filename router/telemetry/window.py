"""The last minute of traffic per region, for the status page: share, errors, TTFT p50/p99.

Prometheus histograms answer "over the last minute" only through a query server; the
status page must answer it alone. Each region keeps 60 one-second slots; a slot holds
counts and two log-scale latency histograms (bins 10% wide), so recording a request is
O(1) and a quantile is read to within about 5%. A slot older than the window is reset
when it is reused, so memory stays fixed however heavy the traffic.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from router.core.outcome import Attempt, RequestRecord

WINDOW_S = 60
_GROWTH = 1.1  # each bin is 10% wider than the one before
_LOG_GROWTH = math.log(_GROWTH)
_BINS = 180  # 1 ms * 1.1**180 ~ 28 hours: everything fits
NO_REGION = "none"  # requests that were never routed (no capacity, unknown model)


def _bin(value_ms: float) -> int:
    if value_ms <= 1.0:
        return 0
    return min(_BINS - 1, int(math.log(value_ms) / _LOG_GROWTH) + 1)


def _bin_value_ms(index: int) -> float:
    """A representative value of a bin: the geometric middle of its bounds."""
    if index == 0:
        return 1.0
    return float(_GROWTH ** (index - 0.5))


class _Slot:
    __slots__ = ("e2e", "errors", "requests", "second", "ttft")

    def __init__(self) -> None:
        self.second = -1
        self.requests = 0
        self.errors = 0
        self.ttft: list[int] | None = None
        self.e2e: list[int] | None = None

    def reset(self, second: int) -> None:
        self.second = second
        self.requests = 0
        self.errors = 0
        self.ttft = None
        self.e2e = None


@dataclass(frozen=True, slots=True)
class RegionTraffic:
    """One region's last minute. Latencies in ms, None without samples."""

    requests: int
    errors: int
    share: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    e2e_p50_ms: float | None
    e2e_p99_ms: float | None


def quantile_ms(bins: list[int], q: float) -> float | None:
    total = sum(bins)
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for index, count in enumerate(bins):
        seen += count
        if seen >= rank and count:
            return round(_bin_value_ms(index), 1)
    return None  # pragma: no cover - the loop always reaches the rank


class TrafficWindow:
    """An observer of finished requests; `summary()` reads the last minute per region.

    A request counts for the region that served it (`none` if it never reached a worker);
    TTFT is from arrival at the router to the first streamed byte, so it is measured only
    for streams; E2E is arrival to last byte, for every answered request.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._regions: dict[str, list[_Slot]] = {}

    def attempt_finished(self, attempt: Attempt) -> None:
        return None

    def request_finished(self, record: RequestRecord) -> None:
        served = record.served_by
        region = served.region if served is not None else (
            record.attempts[-1].region if record.attempts else NO_REGION)
        now_s = self._clock()
        second = int(now_s)
        slots = self._regions.get(region)
        if slots is None:
            slots = self._regions[region] = [_Slot() for _ in range(WINDOW_S)]
        slot = slots[second % WINDOW_S]
        if slot.second != second:
            slot.reset(second)
        slot.requests += 1
        if record.status >= 500:
            slot.errors += 1
        if served is None or served.first_byte_s is None:
            return
        finished_s = record.finished_s if record.finished_s is not None else now_s
        if slot.e2e is None:
            slot.e2e = [0] * _BINS
        slot.e2e[_bin((finished_s - record.received_s) * 1000.0)] += 1
        if record.stream:
            if slot.ttft is None:
                slot.ttft = [0] * _BINS
            slot.ttft[_bin((served.first_byte_s - record.received_s) * 1000.0)] += 1

    def summary(self) -> dict[str, RegionTraffic]:
        """Per region over the last WINDOW_S seconds; `share` is of all requests seen."""
        oldest = int(self._clock()) - WINDOW_S + 1
        totals: dict[str, tuple[int, int, list[int], list[int]]] = {}
        for region, slots in self._regions.items():
            requests = errors = 0
            ttft = [0] * _BINS
            e2e = [0] * _BINS
            for slot in slots:
                if slot.second < oldest:
                    continue
                requests += slot.requests
                errors += slot.errors
                if slot.ttft is not None:
                    ttft = [a + b for a, b in zip(ttft, slot.ttft, strict=True)]
                if slot.e2e is not None:
                    e2e = [a + b for a, b in zip(e2e, slot.e2e, strict=True)]
            totals[region] = (requests, errors, ttft, e2e)
        everything = sum(t[0] for t in totals.values())
        return {
            region: RegionTraffic(
                requests=requests,
                errors=errors,
                share=round(requests / everything, 4) if everything else 0.0,
                ttft_p50_ms=quantile_ms(ttft, 0.5),
                ttft_p99_ms=quantile_ms(ttft, 0.99),
                e2e_p50_ms=quantile_ms(e2e, 0.5),
                e2e_p99_ms=quantile_ms(e2e, 0.99),
            )
            for region, (requests, errors, ttft, e2e) in totals.items()
            if requests
        }
