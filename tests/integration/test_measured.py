"""What the router measures against what it predicted, and by traffic class: a real router
in front of a simulated worker that takes 20 ms per decode step, scraped on /metrics.

The simulator's pace makes the numbers checkable: every token after the first comes one
decode step (>= 20 ms) after the one before, and the first token takes a step too, so a
1 ms TTFT budget cannot be met and a budget of hours always is.
"""

from __future__ import annotations

import json

import pytest

from tests.integration.operators_fleet import CHAT, OpsFleet, Samples, post, scrape, value

pytestmark = pytest.mark.integration

STEP_MS = 20.0
STREAM = {**CHAT, "stream": True, "max_tokens": 6}
BATCH = {"x-globalpool-class": "batch"}


def cls(name: str) -> dict[str, str]:
    return {"class": name}  # (`class` is a keyword)


def gaps_over(samples: Samples, seconds: str, **labels: str) -> float:
    """How many router-measured chunk gaps were counted over `seconds` (a bucket bound)."""
    return (value(samples, "globalpool_itl_seconds_count", **labels)
            - value(samples, "globalpool_itl_seconds_bucket", le=seconds, **labels))


async def test_streams_are_measured_by_class_with_their_gaps_and_prediction_error(
        fleet: OpsFleet) -> None:
    await fleet.start({"a": "us-east"}, decode_step_ms=STEP_MS)
    predicted_ms = []
    for headers in ({}, {}, {}, BATCH, BATCH):
        status, answer_headers, body = await post(fleet.url, STREAM, headers)
        assert status == 200 and body.count(b"data: ") >= 6
        predicted = answer_headers.get("x-globalpool-predicted-ttft-ms")
        if predicted is not None:
            predicted_ms.append(float(predicted))
    status, _, body = await post(fleet.url, {**CHAT, "max_tokens": 6})  # not a stream
    assert status == 200 and json.loads(body)["choices"]

    samples = await scrape(fleet.url)
    labels = {"region": "us-east", "model": "m"}
    assert value(samples, "globalpool_ttft_seconds_count", **labels, **cls("interactive")) == 3
    assert value(samples, "globalpool_ttft_seconds_count", **labels, **cls("batch")) == 2
    assert value(samples, "globalpool_e2e_seconds_count", **cls("interactive")) == 4
    assert value(samples, "globalpool_e2e_seconds_count", **cls("batch")) == 2

    # Five tokens after the first, each a decode step later: the router sees them as
    # (about) five reads, over at least five steps; each stream's gaps are observed at
    # their mean, so all of them lie above 10 ms (the end of the stream may come in a
    # read of its own: a sixth, shorter gap, still a mean over 16 ms).
    for name, streams in (("interactive", 3), ("batch", 2)):
        gaps = value(samples, "globalpool_itl_seconds_count", **labels, **cls(name))
        assert 3 * streams <= gaps <= 8 * streams, name
        assert gaps_over(samples, "0.01", **labels, **cls(name)) == gaps, name
        assert value(samples, "globalpool_itl_seconds_sum", **labels, **cls(name)) >= (
            streams * 5 * STEP_MS / 1000.0 * 0.95), name
    assert value(samples, "globalpool_itl_seconds_count") == value(
        samples, "globalpool_itl_seconds_count", **labels)  # the non-streaming answer: none

    # Measured over predicted TTFT: one per stream that had a prediction; the
    # non-streaming request has no TTFT to compare.
    ratios = value(samples, "globalpool_ttft_prediction_ratio_count")
    assert ratios == len([p for p in predicted_ms if p > 0.0])
    if ratios:  # each first byte took a decode step at least: so much over its prediction
        assert value(samples, "globalpool_ttft_prediction_ratio_sum") >= sum(
            0.8 * STEP_MS / p for p in predicted_ms if p > 0.0)  # (p is rounded)
        assert value(samples, "globalpool_ttft_prediction_ratio_count", **cls("batch")) == sum(
            1 for p in predicted_ms[3:] if p > 0.0)
    assert value(samples, "globalpool_ttft_budget_requests_total") == 0  # nobody asked


async def test_ttft_budgets_are_counted_met_or_missed_when_measured(fleet: OpsFleet) -> None:
    await fleet.start({"a": "us-east"}, decode_step_ms=STEP_MS)
    huge = {"x-globalpool-ttft-budget-ms": "3600000"}
    tiny = {"x-globalpool-ttft-budget-ms": "1"}
    for headers in (huge, huge, tiny, {**tiny, **BATCH}):
        status, _, _ = await post(fleet.url, STREAM, headers)
        assert status == 200
    status, _, _ = await post(fleet.url, CHAT, huge)  # not a stream: no TTFT, not counted
    assert status == 200
    status, _, _ = await post(fleet.url, {**STREAM, "model": "nope"}, huge)  # never starts
    assert status == 404

    samples = await scrape(fleet.url)
    budget = "globalpool_ttft_budget_requests_total"
    assert value(samples, budget, region="us-east", model="m", outcome="met",
                 **cls("interactive")) == 2
    assert value(samples, budget, region="us-east", model="m", outcome="missed",
                 **cls("interactive")) == 1
    assert value(samples, budget, outcome="missed", **cls("batch")) == 1
    assert value(samples, budget, region="none", outcome="missed") == 1
    assert value(samples, budget) == 5

