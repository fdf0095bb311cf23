"""`globalpool bench --quick`: the real test bed, one trace, three policies, the orderings
that must hold.

Brings up 3 regions x 2 simulated workers behind emulated networks, a router replica per
region sharing one Valkey, and replays the quick skewed-3region trace (20 s, ~490
requests) against predicted_ttft, nearest and power_of_two through the command. About
2-3 minutes on 2 cores, so it runs with `pytest -m slow` (as the drills do).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(480)]

POLICIES = ("predicted_ttft", "nearest", "power_of_two")


@pytest.fixture(autouse=True)
def _only_when_slow_tests_are_asked_for(request: pytest.FixtureRequest) -> None:
    if "slow" not in (request.config.getoption("markexpr") or "").replace("not slow", ""):
        pytest.skip("the quick benchmark takes 2-3 minutes: run with `pytest -m slow`")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], str]:
    out = tmp_path_factory.mktemp("bench") / "out"
    saved = out.parent / "saved-trace.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "router.cli", "bench", "--quick",
         "--policies", ",".join(POLICIES), "--out", str(out), "--save-trace", str(saved)],
        cwd=ROOT, capture_output=True, text=True, timeout=420,
    )
    assert result.returncode in (0, 3), result.stdout[-3000:] + result.stderr[-3000:]
    return out, json.loads((out / "results.json").read_text()), result.stdout + result.stderr


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


def test_affinity_raises_the_prefix_hit_rate_without_raising_p99(
        quick_run: tuple[Path, dict[str, Any], str]) -> None:
    """Against power_of_two (no affinity, no locality). "Without raising P99" allows 25 %:
    on the quick trace the two P99s are within ~15 % of each other, in either order, from
    run to run and on the virtual-time twin, so a strict `<=` would fail at random."""
    runs = quick_run[1]["policies"]
    ours, spread = runs["predicted_ttft"], runs["power_of_two"]
    assert ours["routes"].get("affinity", 0) > 0
    assert ours["prefix_hit_rate"] > spread["prefix_hit_rate"]
    assert (ours["interactive"]["ttft_ms"]["p99"]
            <= 1.25 * spread["interactive"]["ttft_ms"]["p99"])
