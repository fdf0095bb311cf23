"""results.json (every number), report.md (the table a person reads) and the PNGs.

Goals (on skewed-3region; a goal whose policies were not run is "not run"):
- `predicted_ttft`'s interactive P99 TTFT is at most half of the best baseline's;
- `predicted_ttft` keeps >= 99 % of interactive requests within the TTFT target, while
  `nearest` (siloed pools) stays below 90 %;
- with several router replicas, no region's traffic share oscillates under
  `predicted_ttft` (oscillation index <= 1.5 and no swing; stats.oscillation).
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

from lab.bench.scenario import Scenario
from lab.bench.stats import DEFINITIONS
from lab.bench.trace import Trace

PREDICTED = "predicted_ttft"
BASELINES = ("nearest", "round_robin", "least_load", "power_of_two", "random")
OSCILLATION_LIMIT = 1.5


def _interactive_p99(run: dict[str, Any]) -> float | None:
    value = run["interactive"]["ttft_ms"]["p99"]
    return None if value is None else float(value)


def goals(runs: dict[str, dict[str, Any]], replicas: int) -> list[dict[str, Any]]:
    """Each goal: what it says, what was measured, and met (True/False/None: not run)."""
    found: list[dict[str, Any]] = []
    ours = runs.get(PREDICTED)
    baselines = {name: _interactive_p99(runs[name]) for name in BASELINES if name in runs}
    measured = {name: p99 for name, p99 in baselines.items() if p99 is not None}
    if ours is not None and measured:
        best_name = min(measured, key=lambda name: measured[name])
        p99 = _interactive_p99(ours)
        found.append({
            "goal": "predicted_ttft interactive P99 TTFT <= 1/2 of the best baseline's",
            "measured": f"{p99} ms vs {measured[best_name]} ms ({best_name})",
            "met": p99 is not None and p99 <= 0.5 * measured[best_name]})
    else:
        found.append({"goal": "predicted_ttft interactive P99 TTFT <= 1/2 of the best "
                      "baseline's", "measured": "not run", "met": None})
    slo = ours["slo_attainment"] if ours else None
    found.append({"goal": "predicted_ttft interactive SLO attainment >= 99 %",
                  "measured": "not run" if ours is None else f"{_pct(slo)}",
                  "met": None if ours is None else slo is not None and slo >= 0.99})
    nearest = runs.get("nearest")
    near_slo = nearest["slo_attainment"] if nearest else None
    found.append({"goal": "nearest (siloed) interactive SLO attainment < 90 %",
                  "measured": "not run" if nearest is None else f"{_pct(near_slo)}",
                  "met": None if nearest is None else near_slo is not None and near_slo < 0.9})
    if ours is not None and replicas >= 2:
        wave = ours["oscillation"]
        found.append({
            "goal": f"no oscillating traffic share with {replicas} router replicas "
                    f"(predicted_ttft: index <= {OSCILLATION_LIMIT}, no swing)",
            "measured": f"index {wave['index']}, swings {wave['swings']}",
            "met": wave["index"] is not None and wave["index"] <= OSCILLATION_LIMIT
            and wave["swings"] == 0})
    else:
        found.append({"goal": "no oscillating traffic share with several router replicas",
                      "measured": "not run" if ours is None else f"{replicas} replica",
                      "met": None})
    return found


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def build_results(*, scenario: Scenario, scenario_file: Path, trace: Trace,
                  runs: dict[str, dict[str, Any]], twin: dict[str, dict[str, Any]],
                  replicas: int, router_regions: list[str], quick: bool, command: str
                  ) -> dict[str, Any]:
    found = goals(runs, replicas)
    return {
        "benchmark": "globalpool bench",
        "command": command,
        "scenario": {
            "name": scenario.name, "file": str(scenario_file), "quick": quick,
            "description": scenario.description,
            "duration_s": trace.duration_s,
            "interactive_ttft_slo_ms": scenario.interactive_ttft_slo_ms,
            "engine": scenario.engine.model_dump(),
            "regions": {name: spec.model_dump() for name, spec in scenario.regions.items()},
        },
        "trace": trace.header,
        "test_bed": {
            "router_replicas": replicas, "router_regions": router_regions,
            "network": "client -> its region's router: loopback (no delay); router -> "
                       "worker: user-space netem adding RTT(router region, worker region)",
        },
        "definitions": DEFINITIONS,
        "policies": runs,
        "twin": twin,
        "goals": found,
        "goals_met": all(goal["met"] is not False for goal in found),
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(),
                 "load_average_1m_at_end": round(os.getloadavg()[0], 2)},
    }


def write_outputs(out: Path, results: dict[str, Any]) -> None:
    from lab.bench.markdown import render
    from lab.bench.plot import regions_png, ttft_cdf_png

    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "report.md").write_text(render(results))
    ttft_cdf_png(results, out)
    regions_png(results, out)
