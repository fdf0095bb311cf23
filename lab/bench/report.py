"""results.json (every number), report.md (the table a person reads) and the PNGs.

Goals (a goal whose policies were not run, or whose numbers are missing, is "not run"):
- on every scenario, against the `oracle` (exact engine state at every decision), which
  exists only on the virtual-time twin, so the twin's predicted_ttft is compared with it,
  the same trace on the same model (the test bed's predicted_ttft is shown beside it, for
  what the machine adds): predicted_ttft's interactive SLO attainment within 0.5 points
  of the oracle's, and its interactive P99 TTFT at most 1.1x the oracle's;
- on `hetero-3region` and `prefix-heavy`, where where a request goes decides its TTFT
  most: predicted_ttft's interactive P99 TTFT at most half of the best baseline's, on
  the test bed (the twin's ratio shown beside it);
- on `skewed-3region`: predicted_ttft keeps >= 99 % of interactive requests within the
  TTFT target while `nearest` (siloed pools) stays below 90 %, and with several router
  replicas no region's traffic share oscillates under predicted_ttft (oscillation index
  <= 1.5 and no swing; stats.oscillation).
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lab.bench.scenario import Scenario
from lab.bench.stats import DEFINITIONS
from lab.bench.trace import Trace
from lab.bench.twin import ORACLE

PREDICTED = "predicted_ttft"
BASELINES = ("nearest", "round_robin", "least_load", "power_of_two", "random")
OSCILLATION_LIMIT = 1.5
ORACLE_SLO_POINTS = 0.5  # percentage points
ORACLE_P99_RATIO = 1.1
BASELINE_P99_RATIO = 0.5
BASELINE_GOAL_SCENARIOS = ("hetero-3region", "prefix-heavy")
SKEWED = "skewed-3region"


def _interactive_p99(run: dict[str, Any] | None) -> float | None:
    value = None if run is None else run["interactive"]["ttft_ms"]["p99"]
    return None if value is None else float(value)


def _slo(run: dict[str, Any] | None) -> float | None:
    return None if run is None else run.get("slo_attainment")


def _goal(goal: str, measured: str, met: bool | None) -> dict[str, Any]:
    return {"goal": goal, "measured": measured, "met": met}


def goals(runs: dict[str, dict[str, Any]], replicas: int,
          twin: dict[str, dict[str, Any]] | None = None, scenario: str = SKEWED
          ) -> list[dict[str, Any]]:
    """Each goal: what it says, what was measured, and met (True/False/None: not run)."""
    twin = twin or {}
    found = oracle_goals(runs, twin)
    if scenario in BASELINE_GOAL_SCENARIOS:
        found.append(baseline_goal(runs, twin))
    if scenario == SKEWED:
        found += skewed_goals(runs, replicas)
    return found


def oracle_goals(runs: dict[str, dict[str, Any]], twin: dict[str, dict[str, Any]]
                 ) -> list[dict[str, Any]]:
    """predicted_ttft against the oracle: twin with twin; the test bed's beside them."""
    ours, oracle, bed = twin.get(PREDICTED), twin.get(ORACLE), runs.get(PREDICTED)
    slo_goal = (f"predicted_ttft interactive SLO attainment within {ORACLE_SLO_POINTS:g} "
                "points of the oracle's (twin vs twin)")
    ours_slo, oracle_slo = _slo(ours), _slo(oracle)
    if ours_slo is None or oracle_slo is None:
        found = [_goal(slo_goal, "not run", None)]
    else:
        found = [_goal(slo_goal, f"twin {_pct(ours_slo)} vs oracle {_pct(oracle_slo)} "
                       f"(test bed {_pct(_slo(bed))})",
                       ours_slo >= oracle_slo - ORACLE_SLO_POINTS / 100.0)]
    p99_goal = (f"predicted_ttft interactive P99 TTFT <= {ORACLE_P99_RATIO:g}x the oracle's "
                "(twin vs twin)")
    ours_p99, oracle_p99 = _interactive_p99(ours), _interactive_p99(oracle)
    if ours_p99 is None or oracle_p99 is None or oracle_p99 <= 0:
        found.append(_goal(p99_goal, "not run", None))
    else:
        bed_p99 = _interactive_p99(bed)
        beside = ("" if bed_p99 is None else
                  f"; test bed {bed_p99} ms = {bed_p99 / oracle_p99:.2f}x the oracle's")
        found.append(_goal(p99_goal, f"twin {ours_p99} ms vs oracle {oracle_p99} ms "
                           f"= {ours_p99 / oracle_p99:.2f}x{beside}",
                           ours_p99 <= ORACLE_P99_RATIO * oracle_p99))
    return found


def _best_baseline(runs: dict[str, dict[str, Any]]) -> tuple[str, float] | None:
    measured = {name: p99 for name in BASELINES
                if (p99 := _interactive_p99(runs.get(name))) is not None}
    if not measured:
        return None
    name = min(measured, key=lambda n: measured[n])
    return name, measured[name]


def baseline_goal(runs: dict[str, dict[str, Any]], twin: dict[str, dict[str, Any]]
                  ) -> dict[str, Any]:
    """predicted_ttft's interactive P99 against the best baseline's, on the test bed."""
    goal = (f"predicted_ttft interactive P99 TTFT <= {BASELINE_P99_RATIO:g}x the best "
            "baseline's (test bed)")
    best, p99 = _best_baseline(runs), _interactive_p99(runs.get(PREDICTED))
    if best is None or p99 is None or best[1] <= 0:
        return _goal(goal, "not run", None)
    twin_best, twin_p99 = _best_baseline(twin), _interactive_p99(twin.get(PREDICTED))
    beside = ("" if twin_best is None or twin_p99 is None or twin_best[1] <= 0 else
              f"; twin {twin_p99} ms vs {twin_best[1]} ms ({twin_best[0]}) = "
              f"{twin_p99 / twin_best[1]:.2f}x")
    return _goal(goal, f"{p99} ms vs {best[1]} ms ({best[0]}) = {p99 / best[1]:.2f}x{beside}",
                 p99 <= BASELINE_P99_RATIO * best[1])


def skewed_goals(runs: dict[str, dict[str, Any]], replicas: int) -> list[dict[str, Any]]:
    """skewed-3region's own: SLO >= 99 %, siloed pools below 90 %, no oscillation."""
    found: list[dict[str, Any]] = []
    ours = runs.get(PREDICTED)
    slo = _slo(ours)
    found.append(_goal("predicted_ttft interactive SLO attainment >= 99 %",
                       "not run" if ours is None else f"{_pct(slo)}",
                       None if ours is None else slo is not None and slo >= 0.99))
    nearest = runs.get("nearest")
    near_slo = _slo(nearest)
    found.append(_goal("nearest (siloed) interactive SLO attainment < 90 %",
                       "not run" if nearest is None else f"{_pct(near_slo)}",
                       None if nearest is None else near_slo is not None and near_slo < 0.9))
    if ours is not None and replicas >= 2:
        wave = ours["oscillation"]
        found.append(_goal(
            f"no oscillating traffic share with {replicas} router replicas "
            f"(predicted_ttft: index <= {OSCILLATION_LIMIT}, no swing)",
            f"index {wave['index']}, swings {wave['swings']}",
            wave["index"] is not None and wave["index"] <= OSCILLATION_LIMIT
            and wave["swings"] == 0))
    else:
        found.append(_goal("no oscillating traffic share with several router replicas",
                           "not run" if ours is None else f"{replicas} replica", None))
    return found


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def build_results(*, scenario: Scenario, scenario_file: Path, trace: Trace,
                  runs: dict[str, dict[str, Any]], twin: dict[str, dict[str, Any]],
                  replicas: int, router_regions: list[str], quick: bool, command: str,
                  stuck_routers: Sequence[str] = ()
                  ) -> dict[str, Any]:
    found = goals(runs, replicas, twin, scenario.name)
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
            "sync_bursts": scenario.sync_bursts.model_dump(),
            "host_noise": scenario.host_noise.model_dump(),
        },
        "trace": trace.header,
        "test_bed": {
            "router_replicas": replicas, "router_regions": router_regions,
            "stuck_routers": list(stuck_routers),
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
    from lab.bench.plot import prediction_error_png, regions_png, ttft_cdf_png

    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "report.md").write_text(render(results))
    ttft_cdf_png(results, out)
    regions_png(results, out)
    prediction_error_png(results, out)
