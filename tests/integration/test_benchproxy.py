"""`globalpool bench-proxy --quick` runs end to end and writes numbers (peers skipped)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.integration


@pytest.mark.timeout(90)
@pytest.mark.slow(why="a bench-proxy run with a 300-worker fleet (~10 s)")
def test_the_fleet_contender_proxies_while_following_a_fleet_next_to_its_control(
        tmp_path: Path) -> None:
    """`--only globalpool-fleet,globalpool-fleet-elsewhere`: one router follows the
    published fleet (serving another model: every request still reaches a backend), the
    other sees none of it."""
    out = tmp_path / "bench"
    done = subprocess.run(
        [sys.executable, "-m", "router.cli", "bench-proxy", "--out", str(out), "--quick",
         "--only", "globalpool-fleet,globalpool-fleet-elsewhere", "--workloads", "unary",
         "--fleet-workers", "300"],
        cwd=ROOT, capture_output=True, text=True, timeout=80,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    document = json.loads((out / "results.json").read_text())
    rows = {r["router"]: r for r in document["results"]}
    for name in ("globalpool-fleet", "globalpool-fleet-elsewhere"):
        assert rows[name]["status"] == "ok" and rows[name]["errors"] == 0, rows[name]
        assert rows[name]["completed"] > 0 and rows[name]["cpu_us_per_request"] > 0
    versions = json.dumps(document)
    assert "following 300 more workers at 4 Hz" in versions
    assert "300 workers at 4 Hz published elsewhere" in versions


@pytest.mark.timeout(90)
@pytest.mark.slow(why="a quick bench-proxy run (~13 s)")
def test_quick_run_writes_numbers_for_globalpool_and_aiohttp(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    done = subprocess.run(
        [sys.executable, "-m", "router.cli", "bench-proxy", "--out", str(out), "--quick",
         "--only", "globalpool,aiohttp"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    document = json.loads((out / "results.json").read_text())
    rows = {(r["router"], r["workload"]): r for r in document["results"]}
    for router in ("direct", "globalpool", "aiohttp"):
        for workload in ("unary", "stream", "paced"):
            row = rows[(router, workload)]
            assert row["status"] == "ok", row
            assert row["completed"] > 0 and row["requests_per_s"] > 0
            assert row["ttft_ms"]["p99"] >= row["ttft_ms"]["p50"] > 0
            assert row["e2e_ms"]["p50"] >= row["ttft_ms"]["p50"]
    for router in ("globalpool", "aiohttp"):
        for workload in ("unary", "stream", "paced"):
            assert rows[(router, workload)]["cpu_us_per_request"] > 0
    # 32 tokens 10 ms apart cannot finish sooner than ~310 ms, whoever proxies them.
    assert rows[("globalpool", "paced")]["e2e_ms"]["p50"] >= 300
    summary = {(s["router"], s["workload"]): s for s in document["summary"]}
    assert summary[("globalpool", "unary")]["cpu_vs_globalpool"] == pytest.approx(1.0)
    assert "vllm-router" not in {r["router"] for r in document["results"]}
    report = (out / "report.md").read_text()
    assert "globalpool" in report and "aiohttp" in report
    assert "x globalpool" in done.stdout
    assert (out / "cpu_per_request.png").exists() or "matplotlib" in report


@pytest.mark.timeout(60)
def test_workloads_picks_which_are_measured_and_refuses_unknown_names(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    done = subprocess.run(
        [sys.executable, "-m", "router.cli", "bench-proxy", "--out", str(out), "--quick",
         "--only", "globalpool", "--workloads", "unary"],
        cwd=ROOT, capture_output=True, text=True, timeout=45,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    document = json.loads((out / "results.json").read_text())
    measured = {(r["router"], r["workload"]) for r in document["results"]}
    assert measured == {("direct", "unary"), ("globalpool", "unary")}
    wrong = subprocess.run(
        [sys.executable, "-m", "router.cli", "bench-proxy", "--out", str(tmp_path / "x"),
         "--quick", "--only", "globalpool", "--workloads", "unary,bursty"],
        cwd=ROOT, capture_output=True, text=True, timeout=30,
    )
    assert wrong.returncode == 2
    assert "unknown workload(s) bursty (known: unary, stream, paced)" in wrong.stdout


@pytest.mark.timeout(90)
@pytest.mark.slow(why="a small bench-heartbeats run (~30 s)")
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_heartbeat_plane_bench_runs_small_and_reports_what_keeping_the_view_costs(
        tmp_path: Path, signed: bool) -> None:
    """`globalpool bench-heartbeats` at 300 workers: the router keeps up, checks every
    record it takes when signed, and its own account of the fleet view's CPU
    (globalpool_fleet_view_cpu_seconds_total) is a part of its process CPU. Unsigned too:
    the collector-alone step once refused every unsigned record (no `insecure`) and
    measured that."""
    done = subprocess.run(
        [sys.executable, "-m", "router.cli", "bench-heartbeats", "--workers", "300",
         "--seconds", "3", *(["--signed"] if signed else []), "--fleet-view-cpu-share", "0.2",
         "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=80,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "heartbeats.json").read_text())
    assert result["keeps_up"] and result["workers_seen_min"] == 300
    assert result["fleet_view_cpu_share"] == 0.2 and "fleet_view_cpu_share 0.2;" in done.stdout
    assert result["achieved_per_s"] > 0.9 * 1200
    assert (result["router_verified_per_s"] > 0.5 * 1200) == signed
    assert result["router_rss_mb"] > 20 and result["valkey_rss_mb"] > 1
    assert 0 < result["router_fleet_view_cpu_pct"] < result["router_cpu_pct"]
    alone = result["collector_alone"]
    assert alone["records_applied_per_s"] > 0.5 * 1200 and alone["cpu_pct"] > 0
    assert "keeping the fleet view by its own account" in done.stdout
    # Measured before any heartbeat, so that what following the fleet adds is shown.
    assert 0 <= result["idle_router_cpu_pct"] < 50 and "the router idle" in done.stdout
    # What keeping the view, a scrape and a status read do to requests: measured.
    waits = result["request_waits"]
    assert waits["idle"]["count"] > 10 and 0 < waits["idle"]["p50"] <= waits["idle"]["max"]
    assert waits["/metrics"]["status"] == 200 and waits["/metrics"]["bytes"] > 300 * 100
    assert waits["/admin/status"]["status"] == 200 and waits["/admin/status"]["bytes"] > 0
    page = waits["/admin/status?workers=500"]  # what the status page reads: 300 listed
    assert page["status"] == 200 and 0.9 < page["bytes"] / waits["/admin/status"]["bytes"] < 1.1
    assert "longest /health meanwhile" in done.stdout
    # How old the view is: every worker's age in the status reads, the records' pace.
    ages = result["view_age_ms"]
    assert ages["count"] >= 300 and 0 <= ages["p50"] <= ages["max"] < 5000
    assert 0.02 <= result["router_rebuild_interval_s"] <= 2.0
    assert 0.02 <= result["settled_interval_s"] <= 2.0  # the window began once it settled
    assert "age of its" in done.stdout
    assert sum(ages["histogram"].values()) == ages["count"]
    assert (tmp_path / "heartbeats.png").read_bytes().startswith(b"\x89PNG")
