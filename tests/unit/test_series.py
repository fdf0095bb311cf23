"""router.telemetry.series exposes exactly what prometheus_client's own metrics would."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import generate_latest

from router.telemetry.series import LabelledCounter, LabelledHistogram

BUCKETS = (0.005, 0.01, 0.1, 1.0, 10.0)


def _lines(registry: CollectorRegistry) -> list[str]:
    """The exposition without prometheus_client's `_created` timestamps."""
    text = generate_latest(registry).decode()
    return sorted(line for line in text.splitlines() if "_created" not in line)


def test_histogram_and_counter_expose_the_same_as_prometheus_client() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    histogram = LabelledHistogram("x_seconds", "doc", ["region"], BUCKETS, ours)
    reference = Histogram("x_seconds", "doc", ["region"], buckets=BUCKETS, registry=theirs)
    counter = LabelledCounter("y", "doc", ["region", "status"], ours)
    reference_counter = Counter("y", "doc", ["region", "status"], registry=theirs)
    rng = random.Random(3)
    # Values on bucket bounds go to that bucket (le), as in Prometheus.
    values = [*BUCKETS, 0.0, 50.0, *(rng.expovariate(3.0) for _ in range(500))]
    for value in values:
        region = rng.choice(["us", "eu"])
        histogram.observe((region,), value)
        reference.labels(region).observe(value)
        status = rng.choice(["200", "503"])
        counter.inc((region, status))
        reference_counter.labels(region, status).inc()
    assert _lines(ours) == _lines(theirs)


def test_a_histogram_without_labels() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    histogram = LabelledHistogram("route_seconds", "doc", [], BUCKETS, ours)
    reference = Histogram("route_seconds", "doc", buckets=BUCKETS, registry=theirs)
    assert _lines(ours) == _lines(theirs)  # all zeros before the first observation
    for value in (0.001, 0.02, 3.0, 30.0):
        histogram.observe((), value)
        reference.observe(value)
    assert _lines(ours) == _lines(theirs)
