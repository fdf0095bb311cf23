"""Percentiles and the summary of one sample of latencies."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(ordered: Sequence[float], q: float) -> float:
    """The `q`-th percentile (0..100) of an ascending sequence, interpolating linearly
    between the two nearest ranks (numpy's default, "linear"). NaN when empty."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    if not ordered:
        return math.nan
    position = (len(ordered) - 1) * q / 100.0
    lower = math.floor(position)
    upper = min(lower + 1, len(ordered) - 1)
    fraction = position - lower
    return ordered[lower] + (ordered[upper] - ordered[lower]) * fraction


def summarize(values: Sequence[float]) -> dict[str, float]:
    """count, mean, p50, p90, p99 and max of `values` (any order). NaNs when empty."""
    ordered = sorted(values)
    if not ordered:
        return {"count": 0, "mean": math.nan, "p50": math.nan, "p90": math.nan,
                "p99": math.nan, "max": math.nan}
    return {
        "count": len(ordered),
        "mean": sum(ordered) / len(ordered),
        "p50": percentile(ordered, 50),
        "p90": percentile(ordered, 90),
        "p99": percentile(ordered, 99),
        "max": ordered[-1],
    }
