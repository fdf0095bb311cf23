"""Labelled counters and histograms for the request path, at a fraction of the cost of
prometheus_client's.

prometheus_client takes a lock and walks the buckets on every `observe`, and
`labels()` validates on every call: ~17 us of the router's CPU per request for its
request metrics (`globalpool bench-proxy`). These keep plain Python numbers per label
tuple (the event loop is the only writer) and are registered as collectors, so the
exposition is prometheus_client's and reads the same: `<name>_total` for a counter;
`_bucket{le=...}` (cumulative), `_count` and `_sum` for a histogram.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric


class LabelledCounter:
    """A counter per tuple of label values (a prometheus Collector)."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 registry: CollectorRegistry) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.values: dict[tuple[str, ...], float] = {}
        registry.register(self)

    def inc(self, labels: tuple[str, ...], amount: float = 1.0) -> None:
        values = self.values
        values[labels] = values.get(labels, 0.0) + amount

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, value in list(self.values.items()):
            family.add_metric(labels, value)
        yield family

    def describe(self) -> Iterator[Metric]:
        yield CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)


class LabelledHistogram:
    """A histogram per tuple of label values (a prometheus Collector). A value goes to the
    first bucket whose upper bound it does not exceed, as in Prometheus (`le`)."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 buckets: Sequence[float], registry: CollectorRegistry) -> None:
        bounds = sorted(float(b) for b in buckets)
        if not bounds or bounds[-1] != math.inf:
            bounds.append(math.inf)
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.bounds = tuple(bounds)
        # Per label tuple: a count per bucket (not cumulative), then the sum.
        self.series: dict[tuple[str, ...], list[float]] = {}
        if not self.labelnames:  # exposed from the start, as prometheus_client does
            self.series[()] = [0.0] * (len(self.bounds) + 1)
        registry.register(self)

    def observe(self, labels: tuple[str, ...], value: float) -> None:
        counts = self.series.get(labels)
        if counts is None:
            counts = self.series[labels] = [0.0] * (len(self.bounds) + 1)
        counts[bisect_left(self.bounds, value)] += 1
        counts[-1] += value

    def observe_many(self, labels: tuple[str, ...], value: float, times: int) -> None:
        """`times` observations of `value` at once (a stream's gaps at their mean: the
        count and the sum are as if each was observed, the buckets those of the mean)."""
        counts = self.series.get(labels)
        if counts is None:
            counts = self.series[labels] = [0.0] * (len(self.bounds) + 1)
        counts[bisect_left(self.bounds, value)] += times
        counts[-1] += value * times

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, counts in list(self.series.items()):
            cumulative = 0.0
            buckets = []
            for bound, count in zip(self.bounds, counts, strict=False):
                cumulative += count
                buckets.append((_le(bound), cumulative))
            family.add_metric(labels, buckets, counts[-1])
        yield family

    def describe(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)


def _le(bound: float) -> str:
    return "+Inf" if bound == math.inf else repr(bound)
