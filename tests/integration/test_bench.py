"""`globalpool bench --quick`: the real test bed, one trace, three policies, the orderings
that must hold.

Brings up 3 regions x 2 simulated workers behind emulated networks, a router replica per
region sharing one Valkey, and replays the quick skewed-3region trace (20 s, ~490
requests) against predicted_ttft, nearest and power_of_two through the command. About
3 minutes on 2 quiet cores (up to ~8 on a busy machine: the benchmark waits, bounded, for
the CPUs to calm down and reruns a disturbed policy once), so it runs with
`pytest -m slow` (as the drills do). Then prefix-heavy's quick trace against
predicted_ttft alone (about a minute more): the other scenarios' quick variants run on
the virtual-time twin in the unit tier (tests/unit/test_bench_scenarios.py), and in full
on demand.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, skip_unless_slow_tests_are_asked_for

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(720)]

POLICIES = ("predicted_ttft", "nearest", "power_of_two")


QUICK_RUN = "the quick benchmark takes 3-8 minutes"
# The test bed's part (`--time-limit`): on a machine busy with other work the benchmark
# waits less for it to calm down, and runs a disturbed policy again only while that fits.
TIME_LIMIT_S = 480
PREFIX_HEAVY_TIME_LIMIT_S = 240


def _bench(out: Path, time_limit_s: float, *args: str) -> str:
    """`globalpool bench --quick ARGS --out OUT --time-limit S`, its output in a log read as
    it grows (a run that overstays shows where it was); returns that output."""
    log = out.parent / f"{out.parent.name}.log"
    with log.open("w") as sink:
        try:
            result = subprocess.run(
                [sys.executable, "-m", "router.cli", "bench", "--quick", *args,
                 "--out", str(out), "--time-limit", str(time_limit_s)],
                cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, text=True,
                timeout=time_limit_s + 180,
            )
        except subprocess.TimeoutExpired:
            pytest.fail(f"the benchmark overstayed its --time-limit {time_limit_s:g} s by 180 s;"
                        f" its output ends:\n{log.read_text()[-4000:]}")
    output = log.read_text()
    assert result.returncode in (0, 3), output[-6000:]
    return output


@pytest.fixture(autouse=True)
def _only_when_slow_tests_are_asked_for(request: pytest.FixtureRequest) -> None:
    skip_unless_slow_tests_are_asked_for(request.config, QUICK_RUN)


@pytest.fixture(scope="module")
def quick_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
              ) -> tuple[Path, dict[str, Any], str]:
    # Module-scoped fixtures are set up before function-scoped autouse ones: check here too,
    # or a plain `pytest` would run the benchmark only to skip its tests.
    skip_unless_slow_tests_are_asked_for(request.config, QUICK_RUN)
    out = tmp_path_factory.mktemp("bench") / "out"
    saved = out.parent / "saved-trace.jsonl"
    output = _bench(out, TIME_LIMIT_S, "--policies", ",".join(POLICIES),
                    "--save-trace", str(saved))
    results = json.loads((out / "results.json").read_text())
    assert results["test_bed"]["stuck_routers"] == [], output[-6000:]
    return out, results, output


def test_it_writes_every_output_and_leaves_nothing_running(
        quick_run: tuple[Path, dict[str, Any], str]) -> None:
    out, results, output = quick_run
    for name in ("results.json", "report.md", "ttft_cdf.png", "regions_over_time.png",
                 "trace.jsonl", *(f"requests/{p}.jsonl" for p in POLICIES)):
        assert (out / name).stat().st_size > 0, name
    assert (out.parent / "saved-trace.jsonl").read_bytes() == (out / "trace.jsonl").read_bytes()
    assert "[###" in output  # the progress bar
    assert set(results["policies"]) == set(POLICIES)
    assert results["test_bed"]["router_replicas"] == 3
    for name, run in results["policies"].items():
        assert run["requests"] == results["trace"]["requests"], name  # the same trace
        assert run["errors"] <= 0.01 * run["requests"], (name, run["errors_by_phase"])
        assert run["exited_children"] == [], name
        assert run["loadgen"]["skipped"] == 0, name
    report = (out / "report.md").read_text()
    assert "| `predicted_ttft` |" in report and "## Goals" in report


def test_predicted_ttft_beats_siloed_pools_on_p99_ttft(
        quick_run: tuple[Path, dict[str, Any], str]) -> None:
    runs = quick_run[1]["policies"]
    ours, siloed = runs["predicted_ttft"], runs["nearest"]
    assert ours["interactive"]["ttft_ms"]["p99"] < siloed["interactive"]["ttft_ms"]["p99"]
    assert ours["slo_attainment"] > siloed["slo_attainment"]
    # nearest never leaves the origin region; predicted_ttft moves us-east's excess away.
    assert siloed["by_origin"]["us-east"]["traffic_share"]["us-east"] == 1.0
    assert ours["by_origin"]["us-east"]["traffic_share"]["us-east"] < 0.9


def test_affinity_raises_the_prefix_hit_rate_without_a_worse_tail(
        quick_run: tuple[Path, dict[str, Any], str]) -> None:
    """Against power_of_two (no affinity, no locality). The prefix-hit rate is clearly
    higher (~26-28 % against ~19-22 %). The tail is compared where it is measurable on the
    quick trace: SLO attainment and P90. Its P99 is the 4th-worst of ~350 interactive
    requests; predicted_ttft's P99 was 0.94x to 1.42x power_of_two's in quick runs on the
    test bed and 1.12x on the virtual-time twin, so "P99 not raised" is not an ordering
    that holds, and is not asserted (BENCHMARKS.md, Routing policies)."""
    runs = quick_run[1]["policies"]
    ours, spread = runs["predicted_ttft"], runs["power_of_two"]
    assert ours["routes"].get("affinity", 0) > 0
    assert ours["prefix_hit_rate"] > spread["prefix_hit_rate"] + 0.02
    assert ours["slo_attainment"] >= spread["slo_attainment"] - 0.05
    assert (ours["interactive"]["ttft_ms"]["p90"]
            <= 1.25 * spread["interactive"]["ttft_ms"]["p90"])


@pytest.fixture(scope="module")
def prefix_heavy_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                     ) -> dict[str, Any]:
    """prefix-heavy's quick variant, predicted_ttft only (~1 minute): the new scenarios'
    test-bed path (a context length past the simulator's default, prompts of 4k-16k
    tokens, the prediction read from every answer)."""
    skip_unless_slow_tests_are_asked_for(request.config, QUICK_RUN)
    out = tmp_path_factory.mktemp("bench-prefix") / "out"
    _bench(out, PREFIX_HEAVY_TIME_LIMIT_S, "--scenario", "prefix-heavy",
           "--policies", "predicted_ttft")
    assert (out / "prediction_error.png").stat().st_size > 0
    return dict(json.loads((out / "results.json").read_text()))


def test_long_shared_prompts_are_served_cached_and_their_predictions_measured(
        prefix_heavy_run: dict[str, Any]) -> None:
    ours = prefix_heavy_run["policies"]["predicted_ttft"]
    assert ours["errors"] == 0, ours["errors_by_phase"]  # no prompt past the context length
    assert ours["routes"].get("affinity", 0) > 0
    assert ours["prefix_hit_rate"] > 0.2
    error = ours["prediction_error"]
    assert error["count"] == error["eligible"] > 0  # every answer carried its prediction
    assert 0 <= error["p50_abs"] <= error["p90_abs"]
    twin = prefix_heavy_run["twin"]
    assert set(twin) == {"predicted_ttft", "oracle"}
    assert [goal["met"] is not None for goal in prefix_heavy_run["goals"]] == [True, True, False]
