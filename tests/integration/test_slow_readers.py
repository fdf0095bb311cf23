"""`globalpool bench-slow-readers`, short: slow readers among paced streams never count
against the workers that serve them.

200 streams through one router over four fake backends that heartbeat as ready workers;
in run B 5 % of the clients read 1 KB/s through a small receive buffer, so that the router
stops reading their streams from the workers for far longer than its idle bound (the
bench sets 5 s). The goals asserted: no client error in either run, no worker ejected,
no attempt counted as failed against a worker. TTFT figures are reported, not asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, skip_unless_slow_tests_are_asked_for

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]

SLOW_READERS = 10  # 5 % of 200


@pytest.fixture(autouse=True)
def _only_when_slow_tests_are_asked_for(request: pytest.FixtureRequest) -> None:
    skip_unless_slow_tests_are_asked_for(request.config, "two 30-s runs of 200 streams")


def test_slow_readers_cost_the_workers_nothing(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    done = subprocess.run(
        [sys.executable, "-m", "router.cli", "bench-slow-readers", "--out", str(out),
         "--streams", "200", "--slow-share", "0.05", "--rounds", "1", "--window-s", "10",
         "--workers", "4"],
        cwd=ROOT, capture_output=True, text=True, timeout=220,
    )
    # 3: the bench ran and missed a goal (the TTFT ratio may, on a busy machine).
    assert done.returncode in (0, 3), done.stdout[-3000:] + done.stderr[-3000:]
    document = json.loads((out / "results.json").read_text())
    runs = {run["variant"]: run for run in document["runs"]}
    assert set(runs) == {"A", "B"}
    slow = runs["B"]["slow"]
    assert slow["streams"] >= SLOW_READERS, slow
    # They did read slowly: at most 1 KB/s each, over at most the run's length.
    assert slow["bytes_read"] <= SLOW_READERS * 1024 * (runs["B"]["wall_s"] + 2), slow
    for variant, run in runs.items():
        assert run["others"]["completed"] > 0, (variant, run["others"])
        assert run["others"]["errors"] == 0, (variant, run["others"])
        assert run["ejections"] == 0, (variant, run["ejection_events"])
        # The backends never fail: any failure the router counted was a client's fault
        # put on a worker.
        assert run["failures"] == {}, (variant, run["failures"])
    assert runs["A"]["designated"]["errors"] == 0, runs["A"]["designated"]
    summary = document["summary"]
    assert summary["goals"]["no errors"] and summary["goals"]["no ejections"], summary
    assert "TTFT p99" in (out / "report.md").read_text()
    assert (out / "ttft.png").stat().st_size > 0
