"""parse_metrics and performance deltas against a real vLLM 0.32 /metrics capture."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from worker.engine_metrics import MetricsFormatError, MetricsSample, parse_metrics
from worker.engine_performance import (
    PerformanceTracker,
    performance_between,
    prefill_busy_s,
    smoothed_rate,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CAPTURE = (FIXTURES / "vllm-0.32-cpu-metrics.txt").read_text()


def _setter(value: float) -> Callable[[re.Match[str]], str]:
    return lambda match: f"{match.group(1)} {value!r}"


def with_values(text: str, values: dict[str, float]) -> str:
    """The capture with each named sample (all its label sets) set to a new value."""
    for name, value in values.items():
        pattern = re.compile(rf"^({re.escape(name)}(?:\{{[^}}]*\}})?) \S+$", re.MULTILINE)
        text, count = pattern.subn(_setter(value), text)
        assert count, f"{name} not in capture"
    return text


def without(text: str, metric: str) -> str:
    return "\n".join(line for line in text.splitlines() if metric not in line) + "\n"


def zeroed(sample: MetricsSample) -> MetricsSample:
    """The same engine before it served anything."""
    return dataclasses.replace(sample, totals={name: 0.0 for name in sample.totals})


def test_real_capture_gives_load_capacity_and_metric_names() -> None:
    sample = parse_metrics(CAPTURE)
    assert (sample.running, sample.waiting) == (0, 0)
    assert sample.kv_cache_usage == 0.0
    assert sample.kv_usage_metric == "vllm:kv_cache_usage_perc"
    assert (sample.kv_blocks_total, sample.block_size_tokens) == (512, 128)
    assert {"vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
            "vllm:kv_cache_usage_perc"} <= set(sample.metric_names)
    assert "vllm:gpu_cache_usage_perc" not in sample.metric_names


def test_gauges_are_read_from_the_text() -> None:
    text = with_values(CAPTURE, {"vllm:num_requests_running": 7.0,
                                 "vllm:num_requests_waiting": 3.0,
                                 "vllm:kv_cache_usage_perc": 0.42})
    sample = parse_metrics(text)
    assert (sample.running, sample.waiting, sample.in_flight) == (7, 3, 10)
    assert sample.kv_cache_usage == pytest.approx(0.42)


def test_legacy_kv_metric_name_is_read_and_named() -> None:
    legacy = with_values(CAPTURE, {"vllm:kv_cache_usage_perc": 0.25}).replace(
        "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"
    )
    sample = parse_metrics(legacy)
    assert sample.kv_cache_usage == pytest.approx(0.25)
    assert sample.kv_usage_metric == "vllm:gpu_cache_usage_perc"


def test_missing_kv_metric_is_none_not_zero() -> None:
    sample = parse_metrics(without(CAPTURE, "vllm:kv_cache_usage_perc"))
    assert sample.kv_cache_usage is None
    assert sample.kv_usage_metric is None
    assert sample.running == 0


def test_missing_cache_config_leaves_capacity_unknown() -> None:
    sample = parse_metrics(without(CAPTURE, "vllm:cache_config_info"))
    assert (sample.kv_blocks_total, sample.block_size_tokens) == (None, None)


def test_several_engines_add_requests_and_blocks_but_average_kv_usage() -> None:
    first = with_values(CAPTURE, {"vllm:num_requests_running": 2.0,
                                  "vllm:kv_cache_usage_perc": 0.2})
    engine_lines = [line for line in first.splitlines() if 'engine="0"' in line]
    second = [
        line.replace('engine="0"', 'engine="1"')
        .replace("} 2.0", "} 5.0").replace("} 0.2", "} 0.6")
        for line in engine_lines
    ]
    sample = parse_metrics(first + "\n".join(second) + "\n")
    assert sample.running == 7
    assert sample.kv_cache_usage == pytest.approx(0.4)
    assert sample.kv_blocks_total == 1024
    assert sample.totals["vllm:time_to_first_token_seconds_count"] == 500


@pytest.mark.parametrize("text", ["not prometheus at all", "foo{ 1\n"])
def test_garbage_is_a_format_error(text: str) -> None:
    with pytest.raises(MetricsFormatError):
        parse_metrics(text)


def test_other_prometheus_exporters_are_refused() -> None:
    with pytest.raises(MetricsFormatError, match="num_requests_running"):
        parse_metrics("# TYPE up gauge\nup 1\n")


def test_whole_capture_averages_match_vllm_numbers() -> None:
    after = parse_metrics(CAPTURE)
    perf = performance_between(zeroed(after), after)
    assert perf.ttft_ms == pytest.approx(1000 * 21.36019468307495 / 250)
    assert perf.itl_ms == pytest.approx(1000 * 104.0534323200011 / 14150)
    assert perf.e2e_ms == pytest.approx(1000 * 126.43306183815002 / 250)
    # 250 of the 14400 generated tokens came out of prefill, not decode.
    assert perf.decode_tokens_per_s == pytest.approx((14400 - 250) / 104.0534323200011)
    # Each of the 250 prefill phases held one decode step (7.4 ms here), taken out.
    step_s = 104.0534323200011 / (14400 - 250)
    assert perf.prefill_tokens_per_s == pytest.approx(8069 / (5.59349799000438 - 250 * step_s))
    # Decode throughput per sequence and ITL describe the same thing.
    assert perf.itl_ms is not None
    assert perf.decode_tokens_per_s == pytest.approx(1000 / perf.itl_ms)


def test_interval_delta_covers_only_new_requests() -> None:
    before = parse_metrics(CAPTURE)
    after = parse_metrics(with_values(CAPTURE, {
        "vllm:time_to_first_token_seconds_count": 260.0,
        "vllm:time_to_first_token_seconds_sum": 21.36019468307495 + 1.5,
        "vllm:request_prompt_tokens_sum": 8069.0 + 4000,
        "vllm:request_prefill_time_seconds_sum": 5.59349799000438 + 0.5,
    }))
    perf = performance_between(before, after)
    assert perf.ttft_ms == pytest.approx(150.0)
    assert perf.prefill_tokens_per_s == pytest.approx(8000.0)
    assert perf.itl_ms is None
    assert perf.decode_tokens_per_s is None


def test_prompt_tokens_found_in_the_prefix_cache_are_not_prefill_work() -> None:
    # 4,000 prompt tokens in 0.5 s of prefill, 3,000 of them from the prefix cache: the
    # engine computed 1,000 (2,000 tokens/s), not 8,000 tokens/s.
    before = parse_metrics(CAPTURE)
    changes = {
        "vllm:time_to_first_token_seconds_count": 260.0,
        "vllm:request_prompt_tokens_sum": 8069.0 + 4000,
        "vllm:request_prefill_time_seconds_sum": 5.59349799000438 + 0.5,
        "vllm:prefix_cache_queries_total": 8069.0 + 4000,
    }
    cached = parse_metrics(with_values(CAPTURE, {**changes,
                                                 "vllm:prefix_cache_hits_total": 3000.0}))
    assert performance_between(before, cached).prefill_tokens_per_s == pytest.approx(2000.0)
    # Hits counted as requests are scheduled may belong to requests not finished yet: a
    # floor of 5 % of the prompt tokens keeps the rate from reading as zero.
    ahead = parse_metrics(with_values(CAPTURE, {**changes,
                                                "vllm:prefix_cache_hits_total": 9000.0}))
    assert performance_between(before, ahead).prefill_tokens_per_s == pytest.approx(400.0)


def test_the_prefill_rate_is_the_engine_s_not_the_prompt_mix_s() -> None:
    # An engine that prefills 10,000 tokens/s, in steps that also take 100 ms to advance
    # its running batch: ten 500-token prompts (each prefill phase: 50 + 100 ms), each
    # answered with 11 tokens (10 decode steps of 100 ms).
    before = parse_metrics(CAPTURE)

    def interval(prompt_tokens: int) -> float | None:
        after = parse_metrics(with_values(CAPTURE, {
            "vllm:request_prefill_time_seconds_count": 250.0 + 10,
            "vllm:request_prefill_time_seconds_sum":
                5.59349799000438 + 10 * (prompt_tokens / 10_000 + 0.1),
            "vllm:request_prompt_tokens_sum": 8069.0 + 10 * prompt_tokens,
            "vllm:request_generation_tokens_sum": 14400.0 + 10 * 11,
            "vllm:request_generation_tokens_count": 250.0 + 10,
            "vllm:request_decode_time_seconds_sum": 104.0534323200011 + 10 * 10 * 0.1,
        }))
        return performance_between(before, after).prefill_tokens_per_s

    assert interval(500) == pytest.approx(10_000)  # prompt tokens / phase: 3,333
    assert interval(5000) == pytest.approx(10_000)  # 8,333
    # 50-token prompts are 5 % of their phase: a fifth of it is kept (the step estimate
    # cannot be trusted to that precision), so 2,381, still 5x closer than 476.
    assert interval(50) == pytest.approx(500 / (0.2 * 1.05))
    assert prefill_busy_s(1.0, 100, 50.0) == pytest.approx(0.2)


def test_no_traffic_gives_none_not_zero() -> None:
    sample = parse_metrics(CAPTURE)
    perf = performance_between(sample, sample)
    assert perf.model_dump() == dict.fromkeys(perf.model_dump())


def test_counter_reset_after_engine_restart_gives_none() -> None:
    before = parse_metrics(CAPTURE)
    restarted = parse_metrics(with_values(CAPTURE, {
        "vllm:time_to_first_token_seconds_count": 3.0,
        "vllm:time_to_first_token_seconds_sum": 0.3,
    }))
    assert performance_between(before, restarted).ttft_ms is None


def test_legacy_itl_name_is_used_when_new_one_is_absent() -> None:
    legacy = parse_metrics(
        CAPTURE.replace("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
    )
    assert "vllm:time_per_output_token_seconds" in legacy.metric_names
    assert performance_between(zeroed(legacy), legacy).itl_ms == pytest.approx(
        1000 * 104.0534323200011 / 14150
    )


def test_token_counters_are_the_fallback_without_request_histograms() -> None:
    text = without(without(CAPTURE, "vllm:request_prompt_tokens"),
                   "vllm:request_generation_tokens")
    sample = parse_metrics(text)
    perf = performance_between(zeroed(sample), sample)
    assert perf.decode_tokens_per_s == pytest.approx(14400 / 104.0534323200011)
    step_s = 104.0534323200011 / 14400
    assert perf.prefill_tokens_per_s == pytest.approx(8069 / (5.59349799000438 - 250 * step_s))


def test_tracker_holds_last_value_through_a_short_lull_then_forgets() -> None:
    quiet = parse_metrics(CAPTURE)
    busy = parse_metrics(with_values(CAPTURE, {
        "vllm:time_to_first_token_seconds_count": 251.0,
        "vllm:time_to_first_token_seconds_sum": 21.36019468307495 + 0.2,
    }))
    tracker = PerformanceTracker(hold_intervals=2)
    assert tracker.update(quiet).ttft_ms is None  # nothing to compare with yet
    assert tracker.update(busy).ttft_ms == pytest.approx(200.0)
    assert tracker.update(busy).ttft_ms == pytest.approx(200.0)  # held, lull 1
    assert tracker.update(busy).ttft_ms == pytest.approx(200.0)  # held, lull 2
    assert tracker.update(busy).ttft_ms is None  # forgotten


def test_the_prefill_rate_is_smoothed_across_intervals() -> None:
    # The engine's rate, not one interval's few prefill phases: each new estimate moves
    # it a quarter of the way (in log space), so one outlier of 4x moves it by 1.41x.
    assert smoothed_rate(None, 8000.0) == 8000.0
    assert smoothed_rate(10_000.0, 40_000.0) == pytest.approx(10_000.0 * 4 ** 0.25)
    assert smoothed_rate(10_000.0, 10_000.0) == pytest.approx(10_000.0)
