"""The shipped benchmark scenarios and their knobs: engine speed per region, synchronized
bursts, long shared prompts, host noise; and each new scenario's quick variant on the
virtual-time twin (fast: virtual time), with the shape results.json keeps."""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from lab.bench.capacity import sim_config
from lab.bench.run import twin_reference
from lab.bench.scenario import SCENARIO_DIR, ScenarioError, load_scenario, parse_scenario
from lab.bench.testbed import config_document
from lab.bench.trace import PromptBuilder, Trace
from lab.bench.twin import ORACLE, Twin
from lab.bench.workload import generate, synchronized_bursts
from lab.sim.tokens import CHARS_PER_TOKEN
from router.config_loader import load_config
from router.core.parse import parse_body, prefix_level_tokens

NEW = ("hetero-3region", "prefix-heavy", "host-noise", "sync-burst")
POLICIES = ("predicted_ttft", "nearest", "round_robin")


def small(**changes: Any) -> dict[str, Any]:
    document: dict[str, Any] = {
        "name": "t", "seed": 3, "duration_s": 10, "interactive_ttft_slo_ms": 500,
        "regions": {"a": {"workers": 1, "rtt_ms": {"a": 1, "b": 50}},
                    "b": {"workers": 1, "rtt_ms": {"b": 1}}},
        "demand": {"a": [{"at": 0.0, "load": 0.5}], "b": [{"at": 0.0, "load": 0.5}]},
    }
    document.update(changes)
    return document


@pytest.fixture(scope="module")
def quick_traces() -> dict[str, Trace]:
    return {name: generate(load_scenario(name), quick=True) for name in NEW}


@pytest.mark.parametrize("name", NEW)
def test_each_new_scenario_ships_explained_with_a_quick_variant(name: str) -> None:
    text = (SCENARIO_DIR / f"{name}.yaml").read_text()
    assert text.startswith(f"# {name}: ")
    assert f"globalpool bench --scenario {name} " in text  # how to run it
    scenario = load_scenario(name)
    assert scenario.name == name
    assert scenario.quick_variant().duration_s <= 20 < scenario.duration_s


def test_a_region_speed_scales_prefill_and_divides_the_decode_step() -> None:
    scenario = parse_scenario(small(regions={
        "a": {"workers": 1, "speed": 2.5, "rtt_ms": {"b": 50}}, "b": {"workers": 1}}))
    fast, plain = scenario.engine_for("a"), scenario.engine_for("b")
    assert plain == scenario.engine
    assert fast.prefill_tokens_per_s == 2.5 * plain.prefill_tokens_per_s
    assert fast.decode_step_ms == plain.decode_step_ms / 2.5
    assert fast.decode_step_ms_per_seq == plain.decode_step_ms_per_seq / 2.5
    assert fast.max_num_seqs == plain.max_num_seqs and fast.kv_blocks == plain.kv_blocks
    with pytest.raises(ScenarioError, match=r"regions\.a\.speed"):
        parse_scenario(small(regions={"a": {"speed": 0}, "b": {}}), "s.yaml")


def test_the_context_length_must_fit_the_kv_cache() -> None:
    engine = {"kv_blocks": 64, "block_size": 16, "max_model_len": 2048}
    with pytest.raises(ScenarioError, match=r"engine: .*max_model_len: 2048 tokens do not fit"):
        parse_scenario(small(engine=engine))
    fits = parse_scenario(small(engine={**engine, "max_model_len": 1024}))
    assert sim_config(fits.engine, "m").max_model_len == 1024


def test_the_knobs_are_bounded_and_name_their_path() -> None:
    with pytest.raises(ScenarioError, match=r"sync_bursts: .*fraction of the run"):
        parse_scenario(small(sync_bursts={"at": [0.5, 1.2], "requests": 4}))
    with pytest.raises(ScenarioError, match=r"host_noise\.duty"):
        parse_scenario(small(host_noise={"processes": 1, "duty": 1.5}))
    with pytest.raises(ScenarioError, match=r"host_noise\.processes"):
        parse_scenario(small(host_noise={"processes": 9}))
    assert parse_scenario(small()).host_noise.processes == 0  # no noise unless asked


def test_speeds_reach_the_capacity_model_and_the_test_beds_engines(tmp_path: Path) -> None:
    scenario = load_scenario("hetero-3region")
    trace = generate(scenario, quick=True)
    per_worker = trace.header["region_worker_capacity_rps"]
    # Every time scales with the speed, so the capacity does too (2.5x / 0.5x = 5x).
    assert per_worker["eu-west"] / per_worker["us-east"] == pytest.approx(5.0, rel=0.05)
    assert per_worker["ap-south"] / per_worker["us-east"] == pytest.approx(2.0, rel=0.05)
    assert trace.header["region_capacity_rps"]["eu-west"] == pytest.approx(
        2 * per_worker["eu-west"], abs=0.01)
    document = config_document(scenario, "predicted_ttft", "us-east", 8080)
    path = tmp_path / "regions.yaml"
    path.write_text(yaml.safe_dump(document))
    config = load_config(path)  # the router's own loader accepts it
    simulated = {name: region.simulated for name, region in config.regions.items()}
    assert simulated["eu-west"].prefill_tokens_per_s == 25_000
    assert simulated["us-east"].decode_step_ms == 160
    assert simulated["ap-south"].decode_step_ms_per_seq == 2.0


def test_sync_bursts_reach_every_origin_at_the_same_instant(
        quick_traces: dict[str, Trace]) -> None:
    scenario = load_scenario("sync-burst").quick_variant()
    trace = quick_traces["sync-burst"]
    spec = scenario.sync_bursts
    origins = sorted(scenario.regions)
    at_s = [round(at * scenario.duration_s, 4) for at in spec.at]
    for moment in at_s:
        same = Counter(r.origin for r in trace.requests if r.at_s == moment)
        assert same == dict.fromkeys(origins, spec.requests), moment
    # The rest of the trace is Poisson: no other instant carries more than a couple.
    by_instant = Counter(r.at_s for r in trace.requests if r.at_s not in at_s)
    assert max(by_instant.values()) <= 2
    assert len(synchronized_bursts(scenario)) == len(spec.at) * len(origins) * spec.requests
    assert synchronized_bursts(parse_scenario(small())) == []


def test_prefix_heavy_prompts_are_long_shared_and_sessions_grow(
        quick_traces: dict[str, Trace]) -> None:
    scenario = load_scenario("prefix-heavy")
    trace = quick_traces["prefix-heavy"]
    systems = {r.system for r in trace.requests if r.system is not None}
    tokens = [chars / CHARS_PER_TOKEN for _, chars in systems]
    assert min(tokens) >= 4_000 and max(tokens) <= 16_000
    groups = {r.system for r in trace.requests if r.prefix_group is not None}
    sessions: dict[str, list[Any]] = {}
    for request in trace.requests:
        if request.session_id is not None:
            sessions.setdefault(request.session_id, []).append(request)
    assert {turns[0].system for turns in sessions.values()} <= groups  # shared preambles
    long = [turns for turns in sessions.values() if len(turns) >= 3]
    assert long
    for turns in long:
        for earlier, later in itertools.pairwise(turns):
            assert later.user[:len(earlier.user)] == earlier.user
            assert later.prompt_chars > earlier.prompt_chars
    builder = PromptBuilder(scenario.model, salt="[00] ")
    keys: dict[Any, list[tuple[int, ...]]] = {}
    for request in trace.requests:
        # As the simulator counts: the messages' contents, one per line.
        text = "\n".join(m["content"] for m in builder.messages(request))
        needed = -(-len(text) // CHARS_PER_TOKEN)
        assert needed + request.max_tokens <= scenario.engine.max_model_len
        if request.system is not None:
            parsed = parse_body(builder.body(request), "chat")
            keys.setdefault(request.system, []).append(parsed.prefix_keys)
    # The requests of one shared prompt, sessions included, share the prompt's prefix keys
    # (affinity can engage), and those credit at least half of it: 4k-16k tokens.
    for (_, chars), found in keys.items():
        shared = 0  # keys that all its requests have in common
        while all(len(ks) > shared and ks[shared] == found[0][shared] for ks in found):
            shared += 1
        assert shared >= 1 and prefix_level_tokens(shared - 1) * 2 * CHARS_PER_TOKEN > chars


def test_host_noise_is_skewed_3region_with_a_hog(quick_traces: dict[str, Trace]) -> None:
    noisy, standard = load_scenario("host-noise"), load_scenario("skewed-3region")
    assert noisy.host_noise.processes >= 1 and 0 < noisy.host_noise.duty < 1
    assert noisy.model_copy(update={"name": standard.name, "description": "",
                                    "host_noise": standard.host_noise}) \
        == standard.model_copy(update={"description": ""})
    assert quick_traces["host-noise"].requests == generate(standard, quick=True).requests


@pytest.mark.parametrize("name", NEW)
def test_the_twin_runs_each_new_quick_variant_with_the_results_shape(
        name: str, quick_traces: dict[str, Trace]) -> None:
    scenario = load_scenario(name).quick_variant()
    trace = quick_traces[name]
    found = twin_reference(scenario, trace, POLICIES, replicas=len(scenario.regions))
    assert set(found) == {*POLICIES, ORACLE}
    for policy, run in found.items():
        assert run["requests"] == len(trace.requests) and run["errors"] == 0, policy
        assert run["interactive"]["ttft_ms"]["p99"] > 0 and 0 <= run["slo_attainment"] <= 1
        assert 0 <= run["home_share"] <= 1 and 0 <= run["prefix_hit_rate"] <= 1
        assert set(run["prediction_error"]) == {"p50_abs", "p90_abs", "count", "eligible"}
    assert found["nearest"]["home_share"] == 1.0
    bursts = found[ORACLE]["sync_bursts"]
    if scenario.sync_bursts.at:
        assert bursts["bursts"] == len(scenario.sync_bursts.at)
        assert bursts["requests_per_burst"] == 3 * scenario.sync_bursts.requests
        assert bursts["max_on_one_worker"] >= bursts["requests_per_burst"] / 6
    else:
        assert bursts is None
    # Every policy predicts with the router's one model, baselines too (they do not
    # choose by it), so each one's prediction error is measured.
    for policy in (*POLICIES, ORACLE):
        error = found[policy]["prediction_error"]
        assert error["count"] == error["eligible"] > 0 and error["p50_abs"] is not None


def test_the_twin_runs_each_region_at_its_speed(quick_traces: dict[str, Trace]) -> None:
    scenario = load_scenario("hetero-3region").quick_variant()
    twin = Twin(scenario, quick_traces["hetero-3region"], "nearest")
    outcomes = twin.run().outcomes

    def median_itl(region: str) -> float:
        values = sorted(itl for o in outcomes if o.region == region
                        and (itl := o.itl_ms) is not None)
        return values[len(values) // 2]

    # A decode step is 32 ms + 0.8 ms a sequence in eu-west, 160 + 4 in us-east.
    assert median_itl("eu-west") < 45 and median_itl("us-east") > 160


def test_the_oracle_moves_requests_off_slow_engines(quick_traces: dict[str, Trace]) -> None:
    scenario = load_scenario("hetero-3region").quick_variant()
    outcomes = Twin(scenario, quick_traces["hetero-3region"], ORACLE).run().outcomes
    from_us = [o for o in outcomes if o.origin == "us-east"]
    served_home = sum(o.region == "us-east" for o in from_us) / len(from_us)
    assert served_home < 0.5  # 80 ms to a 2.5x engine beats a 0.5x one next door
