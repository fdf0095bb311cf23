"""`globalpool bench` traces: seeded, shaped by the scenario, bounded, saved and replayed."""

from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path
from typing import Any

import pytest

from lab.bench.capacity import worker_capacity_rps
from lab.bench.scenario import (
    BoundedLognormal,
    ScenarioError,
    load_scenario,
    parse_scenario,
    shipped_scenarios,
)
from lab.bench.trace import PromptBuilder, Trace, TraceRequest, segment_text
from lab.bench.workload import ContentSource, arrivals, draw, generate
from router.core.parse import PREFIX_CHARS, parse_body


def small(**changes: Any) -> dict[str, Any]:
    """A small two-region scenario document."""
    document: dict[str, Any] = {
        "name": "t", "seed": 3, "duration_s": 20, "interactive_ttft_slo_ms": 500,
        "regions": {"a": {"workers": 1, "rtt_ms": {"a": 1, "b": 50}},
                    "b": {"workers": 1, "rtt_ms": {"b": 1}}},
        "demand": {"a": [{"at": 0.0, "load": 0.5}, {"at": 0.5, "load": 2.0}],
                   "b": [{"at": 0.0, "load": 0.5}, {"at": 0.5, "load": 0.1}]},
    }
    document.update(changes)
    return document


@pytest.fixture(scope="module")
def skewed_trace() -> Trace:
    return generate(load_scenario("skewed-3region"))


def test_the_standard_scenario_ships_and_validates() -> None:
    assert "skewed-3region" in shipped_scenarios()
    scenario = load_scenario("skewed-3region")
    assert set(scenario.regions) == {"us-east", "eu-west", "ap-south"}
    rtts = [scenario.rtt_ms(a, b) for a in scenario.regions for b in scenario.regions if a != b]
    assert min(rtts) >= 10 and max(rtts) <= 200
    assert scenario.quick_variant().duration_s < scenario.duration_s


def test_scenario_errors_name_the_path() -> None:
    document = small(demand={"a": [{"at": 0.0, "load": -1}], "zz": [{"at": 0.0, "load": 1}]})
    with pytest.raises(ScenarioError) as caught:
        parse_scenario(document, "mine.yaml")
    text = str(caught.value)
    assert "mine.yaml: demand.a.0.load" in text
    with pytest.raises(ScenarioError, match="no shipped scenario"):
        load_scenario("no-such-scenario")


def test_the_same_seed_gives_the_same_trace_and_another_seed_does_not() -> None:
    scenario = parse_scenario(small())
    first, again = generate(scenario), generate(scenario)
    assert first.requests == again.requests and first.header == again.header
    other = generate(scenario, seed=4)
    assert [r.at_s for r in other.requests] != [r.at_s for r in first.requests]


def test_the_quick_variant_is_shorter_with_the_same_shape() -> None:
    scenario = parse_scenario(small(quick={"duration_s": 8}))
    quick = generate(scenario, quick=True)
    assert quick.header["quick"] is True and quick.duration_s == 8
    assert all(0 <= r.at_s < 8 for r in quick.requests)


def test_demand_shifts_one_region_past_its_capacity_while_another_falls(
        skewed_trace: Trace) -> None:
    scenario = load_scenario("skewed-3region")
    capacity = skewed_trace.header["region_capacity_rps"]
    duration = skewed_trace.duration_s

    def rate(origin: str, start: float, end: float) -> float:
        count = sum(1 for r in skewed_trace.requests
                    if r.origin == origin and start * duration <= r.at_s < end * duration)
        return count / ((end - start) * duration) / float(capacity[origin])

    # Before the shift every region is under its capacity; during it us-east is far past
    # its own (bursts included) and ap-south far below.
    assert all(rate(r, 0.0, 0.25) < 1.0 for r in scenario.regions)
    assert rate("us-east", 0.3, 0.7) > 1.3
    assert rate("ap-south", 0.3, 0.7) < 0.4
    assert 0.7 <= skewed_trace.header["offered_share_of_capacity"] <= 0.9


def test_requests_are_in_time_order_with_the_workload_mix(skewed_trace: Trace) -> None:
    requests = skewed_trace.requests
    assert [r.at_s for r in requests] == sorted(r.at_s for r in requests)
    assert [r.index for r in requests] == list(range(len(requests)))
    batch = sum(r.traffic_class == "batch" for r in requests) / len(requests)
    assert 0.15 < batch < 0.25
    assert any(r.session_id and r.turn and r.turn >= 3 for r in requests)
    assert len({r.prefix_group for r in requests if r.prefix_group is not None}) > 10
    assert all(r.ttft_budget_ms == 4000 for r in requests if r.traffic_class == "batch")


def test_lengths_are_skewed_and_bounded(skewed_trace: Trace) -> None:
    workload = load_scenario("skewed-3region").workload
    interactive = [r.max_tokens for r in skewed_trace.requests
                   if r.traffic_class == "interactive"]
    spec = workload.output_tokens
    assert min(interactive) >= spec.min and max(interactive) <= spec.max
    assert sum(interactive) / len(interactive) > sorted(interactive)[len(interactive) // 2]
    for request in skewed_trace.requests:
        assert all(workload.prompt_chars.min <= chars <= workload.prompt_chars.max
                   for _, chars in request.user)
        if request.session_id is not None:
            assert request.prompt_chars <= workload.sessions.max_prompt_chars
    rng = random.Random(0)
    spec = BoundedLognormal(median=100, sigma=2.0, min=10, max=300)
    values = [draw(rng, spec) for _ in range(5000)]
    assert min(values) == 10 and max(values) == 300  # the tails are clipped, not dropped
    assert abs(sorted(values)[2500] - 100) < 15


def test_shared_prefixes_are_long_enough_for_the_router_prefix_key(
        skewed_trace: Trace) -> None:
    builder = PromptBuilder("tiny-llama")
    keys: dict[int, set[int | None]] = {}
    for request in skewed_trace.requests[:300]:
        parsed = parse_body(builder.body(request), "chat")
        if request.prefix_group is not None:
            keys.setdefault(request.prefix_group, set()).add(parsed.prefix_keys[0])
        if request.system is not None:
            assert request.system[1] >= PREFIX_CHARS
            assert parsed.prefix_keys
    assert keys and all(len(group_keys) == 1 for group_keys in keys.values())


def test_session_turns_resend_their_history() -> None:
    source = ContentSource(parse_scenario(small()).workload, seed=5)
    turns = [source.next(i, float(i), "a") for i in range(400)]
    by_session: dict[str, list[TraceRequest]] = {}
    for request in turns:
        if request.session_id is not None:
            by_session.setdefault(request.session_id, []).append(request)
    long = [s for s in by_session.values() if len(s) >= 3]
    assert long
    for session in long:
        for earlier, later in itertools.pairwise(session):
            assert later.system == earlier.system
            assert later.user[:len(earlier.user)] == earlier.user
            assert later.turn == earlier.turn + 1  # type: ignore[operator]


def test_salted_prompts_keep_lengths_and_sharing_but_not_bytes(skewed_trace: Trace) -> None:
    request = next(r for r in skewed_trace.requests if r.system is not None)
    plain, salted = PromptBuilder("m", salt="[00] "), PromptBuilder("m", salt="[01] ")
    a, b = plain.messages(request), salted.messages(request)
    assert [len(m["content"]) for m in a] == [len(m["content"]) for m in b]
    assert a != b
    assert segment_text(7, 50) == segment_text(7, 50) and len(segment_text(7, 50)) == 50


def test_a_saved_trace_loads_back_identically(tmp_path: Path, skewed_trace: Trace) -> None:
    path = tmp_path / "trace.jsonl"
    skewed_trace.save(path)
    assert Trace.load(path) == skewed_trace
    header = json.loads(path.read_text().splitlines()[0])
    assert header["format"] == "globalpool-bench-trace/1"
    path.write_text(path.read_text().replace('"at_s":', '"at":', 1))
    with pytest.raises(ValueError, match="line 2"):
        Trace.load(path)


def test_capacity_comes_from_the_engine_model() -> None:
    scenario = parse_scenario(small())
    sample = [TraceRequest(index=i, at_s=0.0, origin="a", traffic_class="interactive",
                           max_tokens=10, user=((i, 400),)) for i in range(80)]
    engine = scenario.engine
    capacity = worker_capacity_rps(engine, sample)
    # Saturated, each step decodes a full batch: 8 sequences of 10 tokens need ~10 full
    # steps plus the prefill of their 100 prompt tokens each.
    step_s = (engine.decode_step_ms + engine.max_num_seqs * engine.decode_step_ms_per_seq) / 1e3
    expected = engine.max_num_seqs / (10 * step_s + 8 * 100 / engine.prefill_tokens_per_s)
    assert math.isclose(capacity, expected, rel_tol=0.15)
    assert worker_capacity_rps(engine, sample) == capacity  # deterministic


def test_arrivals_follow_the_demand_steps() -> None:
    scenario = parse_scenario(small(duration_s=400))
    timed, bursts = arrivals(scenario, {"a": 10.0, "b": 10.0}, seed=1)
    first_half = sum(1 for t, origin in timed if origin == "a" and t < 200) / 200
    second_half = sum(1 for t, origin in timed if origin == "a" and t >= 200) / 200
    assert abs(first_half - 5.0) < 0.6 and abs(second_half - 20.0) < 1.5
    assert bursts == []


def test_the_twin_replays_a_trace_in_virtual_time_with_the_real_policies() -> None:
    from lab.bench.stats import summarize
    from lab.bench.twin import ORACLE, Twin

    scenario = parse_scenario(small(duration_s=10))
    trace = generate(scenario)
    service_s = scenario.engine.max_num_seqs / trace.header["worker_capacity_rps"]

    def run(policy: str) -> dict[str, Any]:
        result = Twin(scenario, trace, policy, service_s=service_s).run()
        assert [o.index for o in result.outcomes] == [r.index for r in trace.requests]
        assert all(o.ok and o.tokens == r.max_tokens
                   for o, r in zip(result.outcomes, trace.requests, strict=True))
        return summarize(result.outcomes, slo_ms=scenario.interactive_ttft_slo_ms,
                         duration_s=trace.duration_s, regions=list(scenario.regions))

    siloed = run("nearest")
    assert siloed["routes"] == {"nearest": len(trace.requests)}
    assert run("nearest") == siloed  # virtual time: the same every time
    pooled = run(ORACLE)
    # a is driven to 2x its capacity for half the run: only a pool that spills meets TTFTs.
    assert pooled["slo_attainment"] > siloed["slo_attainment"]
    assert pooled["interactive"]["ttft_ms"]["p99"] < siloed["interactive"]["ttft_ms"]["p99"]
    assert pooled["traffic_share"]["b"] > siloed["traffic_share"]["b"]


def test_a_saved_trace_is_what_the_benchmark_replays(tmp_path: Path) -> None:
    from lab.bench.run import BenchOptions, load_trace

    scenario = parse_scenario(small())
    saved = generate(scenario, seed=9)
    path = tmp_path / "t.jsonl"
    saved.save(path)
    options = BenchOptions(scenario="t", policies=("nearest",), out=tmp_path, trace_path=path)
    assert load_trace(options, scenario) == saved
    other = parse_scenario(small(regions={"x": {"workers": 1}}, demand={"x": [{"at": 0,
                                                                              "load": 1}]}))
    with pytest.raises(ValueError, match="are not regions of scenario"):
        load_trace(options, other)


def test_the_command_refuses_unknown_policies_before_starting_anything(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from router.cli import main

    assert main(["bench", "--out", str(tmp_path / "out"), "--policies",
                 "predicted_ttft,fastest"]) == 2
    assert "unknown fastest" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_time_limit_shares_what_is_left_among_the_policies_still_to_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--time-limit`: each policy may use its share of the time to the deadline; the waits
    before a replay shrink to fit (never below 5 s, never above the usual 120 s), and a
    rerun happens only while a run as long as the last one fits."""
    import time

    from lab.bench.run import _Budget
    from router.cli import main

    unlimited = _Budget(None, policies_after=2)
    assert unlimited.wait_s(60.0) == 120.0 and unlimited.fits(10_000.0)
    budget = _Budget(time.monotonic() + 300.0, policies_after=2)  # ~100 s each
    assert 15.0 < budget.wait_s(60.0) <= 20.0  # (100 - 60) / 2, shared by two waits
    assert budget.wait_s(200.0) == 5.0
    assert budget.fits(90.0) and not budget.fits(110.0)
    assert _Budget(time.monotonic() + 10_000.0, policies_after=0).wait_s(60.0) == 120.0
    assert _Budget(time.monotonic() - 1.0, policies_after=0).wait_s(1.0) == 5.0

    with pytest.raises(SystemExit) as usage:  # argparse's usage error
        main(["bench", "--out", str(tmp_path / "out"), "--time-limit", "0"])
    assert usage.value.code == 2 and "--time-limit" in capsys.readouterr().err
