"""What a request's record tells of it: a stream's gaps at their mean (and how a histogram
takes them), the client's TTFT, and whether its TTFT budget was met."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from router.core.outcome import Attempt, RequestRecord
from router.telemetry.metrics import ITL_BUCKETS_S
from router.telemetry.series import LabelledHistogram


def test_a_streams_gaps_are_observed_at_their_mean_with_count_and_sum_exact() -> None:
    registry = CollectorRegistry()
    many = LabelledHistogram("many", "d", ["region"], ITL_BUCKETS_S, registry)
    one_by_one = LabelledHistogram("one_by_one", "d", ["region"], ITL_BUCKETS_S, registry)
    # 31 gaps over 0.62 s: a 20 ms mean, as a stream relayed from t=1.0 to t=1.62.
    attempt = Attempt(worker_id="a", region="r", predicted_ttft_ms=0.0, reason="local",
                      started_s=0.9, first_byte_s=1.0, stream_gaps=31, stream_ended_s=1.62)
    assert attempt.mean_itl_s == pytest.approx(0.02)
    assert attempt.mean_itl_s is not None
    many.observe_many(("r",), attempt.mean_itl_s, attempt.stream_gaps)
    for _ in range(31):
        one_by_one.observe(("r",), attempt.mean_itl_s)
    assert many.series[("r",)][:-1] == one_by_one.series[("r",)][:-1]
    assert many.series[("r",)][-1] == pytest.approx(0.62)
    assert sum(many.series[("r",)][:-1]) == 31
    # No gap (one read after the first byte, or none), or no end: nothing to observe.
    assert Attempt(worker_id="a", region="r", predicted_ttft_ms=0.0, reason="local",
                   started_s=0.9, first_byte_s=1.0, stream_ended_s=1.5).mean_itl_s is None
    assert Attempt(worker_id="a", region="r", predicted_ttft_ms=0.0, reason="local",
                   started_s=0.9, first_byte_s=1.0, stream_gaps=3).mean_itl_s is None


def _record(*, stream: bool = True, budget_ms: float | None = 100.0, status: int = 200,
            first_byte_after_s: float | None = 0.05, finished_after_s: float = 1.0
            ) -> RequestRecord:
    record = RequestRecord(model="m", kind="chat", stream=stream, origin_region="us-east",
                           received_s=10.0, ttft_budget_ms=budget_ms, status=status,
                           finished_s=10.0 + finished_after_s)
    if first_byte_after_s is not None:
        record.attempts.append(Attempt(
            worker_id="a", region="us-east", predicted_ttft_ms=20.0, reason="local",
            started_s=10.01, first_byte_s=10.0 + first_byte_after_s, status=status))
    return record


def test_the_clients_ttft_and_whether_its_budget_was_met() -> None:
    assert _record().ttft_s == pytest.approx(0.05)
    assert _record().ttft_budget_met is True
    assert _record(first_byte_after_s=0.2).ttft_budget_met is False
    assert _record(first_byte_after_s=0.1).ttft_budget_met is True  # on the budget: met
    assert _record(budget_ms=None).ttft_budget_met is None
    # Not a stream: no TTFT to compare (its first byte is the whole answer).
    assert _record(stream=False).ttft_s is None
    assert _record(stream=False).ttft_budget_met is None
    # A stream that never started missed it; an error answer is no first token.
    assert _record(first_byte_after_s=None, status=503).ttft_budget_met is False
    assert _record(status=429).ttft_s is None
    assert _record(status=429).ttft_budget_met is False
    # Its client left: before the budget ran out nothing is known, after it it is missed.
    assert _record(first_byte_after_s=None, status=499, finished_after_s=0.05
                   ).ttft_budget_met is None
    assert _record(first_byte_after_s=None, status=499, finished_after_s=0.5
                   ).ttft_budget_met is False
