"""What the clients of a bench-slow-readers run saw, summed up as JSON (see slow_clients)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from lab.benchproxy.stats import percentile, summarize

QUANTILE_STEPS = 1000  # ttft_quantiles_ms holds the 0th, 0.1th, ... 100th percentile


def in_ms(summary: dict[str, float]) -> dict[str, float]:
    """A `stats.summarize` of seconds, in milliseconds (the count stays a count)."""
    return {k: v * 1000 if k != "count" else v for k, v in summary.items()}


@dataclass
class Tally:
    """What the normal clients of one kind saw."""

    completed: int = 0
    ttft_s: list[float] = field(default_factory=list)  # streams started after warm-up
    started_at_s: list[float] = field(default_factory=list)  # each one's start in the run
    errors: int = 0
    error_kinds: Counter[str] = field(default_factory=Counter)
    error_samples: list[str] = field(default_factory=list)

    def error(self, what: str, at_s: float | None = None) -> None:
        self.errors += 1
        self.error_kinds[what.split(":")[0][:80]] += 1
        if len(self.error_samples) < 5:
            when = "" if at_s is None else f"at {at_s:.1f} s: "
            self.error_samples.append(when + what[:300])

    def measured(self, ttft_s: float, at_s: float) -> None:
        self.ttft_s.append(ttft_s)
        self.started_at_s.append(at_s)

    def slowest(self, count: int = 10) -> list[dict[str, float]]:
        """The `count` longest TTFTs, with when in the run their streams started."""
        ranked = sorted(zip(self.ttft_s, self.started_at_s, strict=True), reverse=True)
        return [{"ttft_ms": t * 1000, "started_at_s": at} for t, at in ranked[:count]]

    def timeline(self) -> list[dict[str, float]]:
        """TTFT p50 and p99 of the streams started in each second of the run."""
        by_second: dict[int, list[float]] = {}
        for ttft_s, at_s in zip(self.ttft_s, self.started_at_s, strict=True):
            by_second.setdefault(int(at_s), []).append(ttft_s)
        return [{"second": second, "streams": len(values),
                 "p50_ms": percentile(ordered, 50) * 1000,
                 "p99_ms": percentile(ordered, 99) * 1000}
                for second, values in sorted(by_second.items())
                for ordered in [sorted(values)]]

    def to_json(self) -> dict[str, Any]:
        ordered = sorted(self.ttft_s)
        return {
            "completed": self.completed, "errors": self.errors,
            "error_kinds": dict(self.error_kinds), "error_samples": self.error_samples,
            "slowest": self.slowest(), "timeline": self.timeline(),
            "ttft_ms": in_ms(summarize(ordered)),
            "ttft_quantiles_ms": [percentile(ordered, q * 100 / QUANTILE_STEPS) * 1000
                                  for q in range(QUANTILE_STEPS + 1)] if ordered else [],
        }


@dataclass
class SlowTally:
    """What the slow readers saw, stream by stream: how each ended (`outcomes`)."""

    outcomes: Counter[str] = field(default_factory=Counter)
    ttft_s: list[float] = field(default_factory=list)
    ended_after_s: dict[str, list[float]] = field(default_factory=dict)
    bytes_read: int = 0

    def ended(self, outcome: str, after_s: float) -> None:
        self.outcomes[outcome] += 1
        self.ended_after_s.setdefault(outcome, []).append(after_s)

    def to_json(self) -> dict[str, Any]:
        return {"streams": sum(self.outcomes.values()), "outcomes": dict(self.outcomes),
                "bytes_read": self.bytes_read, "ttft_ms": in_ms(summarize(self.ttft_s)),
                "ended_after_s": {k: summarize(v) for k, v in self.ended_after_s.items()}}
