"""`globalpool drill hostile --quick`: the report's shape, and the goals of every cell the
router is expected to pass.

The quick matrix is each worker fault with a normal client and each client behaviour
against a worker that never answers (17 cells, two lanes of 3 healthy workers + 1 bad, a
fresh router per cell): ~2 minutes on an idle 2-CPU machine.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lab.drill.hostile.run import HostileOptions
from tests.conftest import ROOT, skip_unless_slow_tests_are_asked_for

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(480)]

CELL_KEYS = {"worker_fault", "client_behaviour", "requests", "lost", "healthy_ejected",
             "detect_s", "router_5xx", "rss_mb_before", "rss_mb_after", "goals_missed"}
GOALS = ["lost == 0", "refusals_missed == 0", "healthy_ejected == 0", "detect_s <= 5",
         "router_5xx == 0", "rss_mb_after - rss_mb_before <= 64"]


@pytest.fixture(autouse=True)
def _only_when_slow_tests_are_asked_for(request: pytest.FixtureRequest) -> None:
    skip_unless_slow_tests_are_asked_for(request.config, "the quick hostile drill takes ~2 min")


def test_quick_hostile_drill(tmp_path: Path) -> None:
    out = tmp_path / "hostile"
    result = subprocess.run(
        [sys.executable, "-m", "router.cli", "drill", "hostile", "--quick", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=450,
    )
    report = json.loads((out / "report.json").read_text())
    assert result.returncode == (0 if report["goals_met"] else 3), result.stderr[-3000:]
    for name in ("report.md", "matrix.png", "requests.jsonl"):
        assert (out / name).stat().st_size > 0, name

    planned = HostileOptions(out=out, quick=True).cells()
    cells = report["cells"]
    assert [(c["worker_fault"], c["client_behaviour"]) for c in cells] == planned
    progress = re.findall(rf"^\[\s*\d+/{len(planned)}\] lane \d", result.stdout, re.MULTILINE)
    assert len(progress) == len(planned), result.stdout[-3000:]  # one line per cell
    assert [g["goal"] for g in report["goals"]] == GOALS
    for cell in cells:
        assert cell.keys() >= CELL_KEYS, sorted(CELL_KEYS - cell.keys())
        assert cell["requests"] > 0 and 0 < cell["rss_mb_before"] <= cell["rss_mb_peak"]
    records = (out / "requests.jsonl").read_text().splitlines()
    assert len(records) == sum(c["requests"] for c in cells)
    idle = next(c for c in cells if c["client_behaviour"] == "idle_connections")
    assert idle["idle_connections"]["opened"] == 10_000, idle["idle_connections"]

    missed = {f"{c['worker_fault']} x {c['client_behaviour']}": {
                  "missed": c["goals_missed"], "lost": c["lost_examples"],
                  "router_5xx": c["router_5xx_examples"], "refusals": c["refusal_examples"],
                  "healthy_ejected": c["healthy_ejections"], "detect_s": c["detect_s"]}
              for c in cells if c["goals_missed"]}
    # Every cell meets every goal: a stream that breaks after its first events reached
    # the client (reset mid-stream, a body that never ends) is continued on another worker.
    assert not missed, json.dumps(missed, indent=1)
    assert report["goals_met"]
