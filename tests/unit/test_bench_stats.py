"""`globalpool bench` statistics on literal outcomes: percentiles, SLO, goodput, shares,
oscillation, and the goals."""

from __future__ import annotations

import random
from typing import Any

from lab.bench.observe import EngineSample, parse_engine_metrics, prefix_hit_rate
from lab.bench.replay import Outcome, predicted_ms, unpredicted_ms
from lab.bench.report import goals
from lab.bench.stats import (
    burst_placement,
    distribution,
    oscillation,
    percentile,
    share_bins,
    summarize,
)

REGIONS = ["a", "b"]


def outcome(index: int, *, ttft_ms: float | None = 100.0, cls: str = "interactive",
            region: str | None = "a", origin: str = "a", sent_s: float = 0.0,
            failure: str | None = None, tokens: int = 5) -> Outcome:
    first = None if ttft_ms is None else sent_s + ttft_ms / 1000.0
    return Outcome(index=index, origin=origin, traffic_class=cls, scheduled_s=sent_s,
                   sent_s=sent_s, end_s=(first or sent_s) + 0.4, status=200,
                   first_token_s=first, last_token_s=None if first is None else first + 0.4,
                   tokens=tokens if first is not None else 0, region=region, failure=failure)


def test_percentiles_are_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50 and percentile(values, 99) == 99
    assert percentile(values, 100) == 100 and percentile([], 50) is None
    assert distribution([5.0]) == {"p50": 5.0, "p90": 5.0, "p99": 5.0}


def test_slo_goodput_errors_and_shares() -> None:
    outcomes = [
        outcome(0, ttft_ms=100), outcome(1, ttft_ms=900, region="b"),   # one in, one out
        outcome(2, ttft_ms=None, failure="before_first_byte", region=None),  # a miss too
        outcome(3, ttft_ms=3000, cls="batch"),                            # within budget
        outcome(4, ttft_ms=6000, cls="batch", region="b"),                # over budget
    ]
    summary = summarize(outcomes, slo_ms=500, duration_s=10, regions=REGIONS,
                        budgets={3: 4000.0, 4: 4000.0})
    assert summary["requests"] == 5 and summary["errors"] == 1
    assert summary["errors_by_phase"] == {"before_first_byte": 1}
    assert summary["slo_attainment"] == round(1 / 3, 4)
    assert summary["goodput_rps"] == 0.2  # request 0 and batch request 3, over 10 s
    assert summary["batch"]["budget_attainment"] == 0.5
    assert summary["traffic_share"] == {"a": 0.5, "b": 0.5}
    assert summary["interactive"]["ttft_ms"]["p99"] == 900.0
    assert summary["itl_ms"]["p50"] == 100.0  # 0.4 s over 4 gaps
    assert summarize([], slo_ms=1, duration_s=1, regions=REGIONS)["slo_attainment"] is None


def test_share_bins_count_successes_by_send_second() -> None:
    outcomes = [outcome(0, sent_s=0.2), outcome(1, sent_s=0.9, region="b"),
                outcome(2, sent_s=1.5), outcome(3, sent_s=1.6, failure="mid_stream")]
    outcomes.append(outcome(4, sent_s=1.7, origin="b", region="b"))
    bins = share_bins(outcomes, REGIONS, duration_s=2.0)
    assert [b["requests"] for b in bins] == [2, 2]
    assert bins[0]["served"] == {"a": 1, "b": 1}
    assert bins[1]["by_origin"] == {"a": {"a": 1, "b": 0}, "b": {"a": 0, "b": 1}}


def _bins(shares_a: list[float], per_bin: int, seed: int = 0) -> list[dict[str, Any]]:
    """Requests of origin a, served in region a with the given share per second."""
    rng = random.Random(seed)
    bins = []
    for second, share in enumerate(shares_a):
        served_a = sum(rng.random() < share for _ in range(per_bin))
        served = {"a": served_a, "b": per_bin - served_a}
        bins.append({"t_s": float(second), "requests": per_bin, "served": served,
                     "by_origin": {"a": served}})
    return bins


def test_independent_routing_scores_about_one_and_a_herd_scores_high() -> None:
    steady = oscillation(_bins([0.5] * 400, per_bin=30), REGIONS)
    assert 0.8 < steady["index"] < 1.25 and steady["swings"] == 0
    # A slow shift of the mean (a demand change) is not oscillation either.
    ramp = oscillation(_bins([0.2 + 0.6 * i / 400 for i in range(400)], per_bin=30), REGIONS)
    assert ramp["index"] < 1.3
    # Replicas herding: all to a, then all to b, second by second.
    herd = oscillation(_bins([0.9, 0.1] * 200, per_bin=30), REGIONS)
    assert herd["index"] > 3 and herd["swings"] > 100
    assert herd["by_origin"]["a"]["a"]["share_stdev_pp"] > 30
    # Always served at home (nearest): nothing to measure, not "no oscillation".
    assert oscillation(_bins([1.0] * 50, per_bin=30), REGIONS)["index"] is None


def test_engine_metrics_and_prefix_hit_rate() -> None:
    text = "\n".join([
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
        'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0',
        'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 9.0',
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0',
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 250.0',
        'vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e+09',
    ])
    sample = parse_engine_metrics(text)
    assert sample == EngineSample(running=3, waiting=2, prefix_queries=1000.0,
                                  prefix_hits=250.0)
    before = {"w1": EngineSample(0, 0, 1000.0, 250.0), "w2": EngineSample(0, 0, 0.0, 0.0)}
    after = {"w1": EngineSample(0, 0, 2000.0, 1050.0), "w2": EngineSample(0, 0, 1000.0, 0.0)}
    assert prefix_hit_rate(before, after) == 0.4
    assert prefix_hit_rate(before, after, ["w1"]) == 0.8
    assert prefix_hit_rate(after, after) is None


def _run(p99: float, slo: float, index: float = 1.0, swings: int = 0) -> dict[str, Any]:
    return {"interactive": {"ttft_ms": {"p99": p99}}, "slo_attainment": slo,
            "oscillation": {"index": index, "swings": swings}}


def test_goals_hold_predicted_ttft_to_the_oracle_on_the_twin_and_say_what_was_not_run(
        ) -> None:
    runs = {"predicted_ttft": _run(400, 0.995), "nearest": _run(5000, 0.7),
            "least_load": _run(900, 0.95)}
    twin = {"predicted_ttft": _run(330, 0.984), "oracle": _run(310, 0.986)}
    found = goals(runs, replicas=3, twin=twin, scenario="skewed-3region")
    assert [g["goal"].split(" ")[1] for g in found[:2]] == ["interactive", "interactive"]
    assert [g["met"] for g in found] == [True, True, True, True, True]
    assert "twin 98.4 % vs oracle 98.6 % (test bed 99.5 %)" in found[0]["measured"]
    assert "1.06x" in found[1]["measured"] and "test bed 400.0 ms = 1.29x" in found[1]["measured"]
    # 0.6 points below the oracle misses; so does a P99 past 1.1x its.
    twin["predicted_ttft"] = _run(342, 0.980)
    missed = goals(runs, replicas=3, twin=twin, scenario="skewed-3region")
    assert [g["met"] for g in missed[:2]] == [False, False]
    # No twin, no oracle: not run (never met by default); skewed's own goals still judged.
    only_ours = goals({"predicted_ttft": _run(400, 0.9, index=2.0)}, replicas=1,
                      scenario="skewed-3region")
    assert [g["met"] for g in only_ours] == [None, None, False, None, None]


def test_the_baseline_goal_is_on_the_scenarios_where_routing_decides_most() -> None:
    runs = {"predicted_ttft": _run(400, 0.995), "nearest": _run(5000, 0.7),
            "least_load": _run(900, 0.95)}
    twin = {"predicted_ttft": _run(330, 0.984), "oracle": _run(310, 0.986),
            "least_load": _run(800, 0.9)}
    hetero = goals(runs, replicas=3, twin=twin, scenario="hetero-3region")
    assert len(hetero) == 3 and hetero[2]["met"] is True  # 400 <= 900 / 2
    assert "(least_load) = 0.44x; twin 330.0 ms vs 800.0 ms (least_load)" in hetero[2]["measured"]
    runs["least_load"] = _run(700, 0.97)
    assert goals(runs, replicas=3, twin=twin, scenario="prefix-heavy")[2]["met"] is False
    assert len(goals(runs, replicas=3, twin=twin, scenario="sync-burst")) == 2
    assert goals({"predicted_ttft": _run(400, 0.9)}, replicas=3, twin=twin,
                 scenario="hetero-3region")[2]["met"] is None  # no baseline run


def predicted(index: int, ttft_ms: float | None, predicted_ms: float | None, *,
              unpredicted_ms: float = 0.0, cls: str = "interactive",
              failure: str | None = None) -> Outcome:
    found = outcome(index, ttft_ms=ttft_ms, cls=cls, failure=failure)
    found.predicted_ttft_ms = predicted_ms
    found.unpredicted_ms = unpredicted_ms
    return found


def test_prediction_error_compares_the_prediction_with_what_it_covers() -> None:
    outcomes = [
        predicted(0, 200.0, 100.0),  # |200 - 100| / 200 = 0.5
        predicted(1, 300.0, 100.0, unpredicted_ms=200.0),  # queued 200 ms: 0.0
        predicted(2, 100.0, 125.0),  # 0.25
        predicted(3, 100.0, None),  # no prediction: eligible, not counted
        predicted(4, 100.0, 0.0),  # a baseline's 0.0 is no prediction
        predicted(5, None, 90.0, failure="before_first_byte"),  # failed: not eligible
        predicted(6, 100.0, 10.0, cls="batch"),  # batch: not eligible
    ]
    found = summarize(outcomes, slo_ms=1000, duration_s=1.0, regions=REGIONS)
    assert found["prediction_error"] == {"p50_abs": 0.25, "p90_abs": 0.5, "count": 3,
                                         "eligible": 5}
    none = summarize([predicted(0, 100.0, None)], slo_ms=1000, duration_s=1.0,
                     regions=REGIONS)["prediction_error"]
    assert none == {"p50_abs": None, "p90_abs": None, "count": 0, "eligible": 1}


def test_the_home_share_counts_requests_served_in_their_origin_region() -> None:
    outcomes = [outcome(0, region="a", origin="a"), outcome(1, region="b", origin="a"),
                outcome(2, region="b", origin="b"), outcome(3, region="b", origin="b"),
                outcome(4, region=None, failure="before_first_byte")]
    found = summarize(outcomes, slo_ms=1000, duration_s=1.0, regions=REGIONS)
    assert found["home_share"] == 0.75


def test_the_replayer_reads_the_prediction_and_the_time_it_does_not_cover() -> None:
    assert predicted_ms("412.5") == 412.5
    assert predicted_ms("0.0") is None and predicted_ms(None) is None
    assert predicted_ms("soon") is None
    assert unpredicted_ms("route;dur=0.210") == 0.0
    assert unpredicted_ms("route;dur=0.2, queue;dur=150.500, retry;dur=20.25") == 170.75
    assert unpredicted_ms('queue;desc="x";dur=5, retry;dur=bad') == 5.0
    assert unpredicted_ms(None) == 0.0


def test_burst_placement_finds_a_herd_on_one_worker() -> None:
    def sent(index: int, at_s: float, worker: str, ttft_ms: float = 100.0) -> Outcome:
        found = outcome(index, sent_s=at_s, ttft_ms=ttft_ms)
        found.worker = worker
        return found

    spread = [sent(i, 1.0, f"w{i % 4}") for i in range(8)]  # 2 on each of 4
    herd = [sent(10 + i, 2.0, "w0" if i < 6 else "w1", 400.0) for i in range(8)]
    other = [sent(20, 1.5, "w0"), sent(21, 1.5, "w0")]  # not at a burst instant
    found = burst_placement(spread + herd + other, [1.0, 2.0])
    assert found == {"bursts": 2, "requests_per_burst": 8, "max_on_one_worker_mean": 4.0,
                     "max_on_one_worker": 6,
                     "ttft_ms": {"p50": 100.0, "p90": 400.0, "p99": 400.0}}
    assert burst_placement(spread, []) is None
