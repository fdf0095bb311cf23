"""The prediction error taken apart on the twin (lab.bench.error_parts)."""

from __future__ import annotations

from lab.bench import stats
from lab.bench.error_parts import ESTIMATES, PartsTwin, error_parts
from lab.bench.scenario import load_scenario
from lab.bench.twin import Twin
from lab.bench.workload import generate


def test_the_error_as_predicted_is_the_benchmarks_and_the_engines_wait_explains_most() -> None:
    base = load_scenario("skewed-3region")
    scenario = base.quick_variant()
    trace = generate(base, quick=True)
    rows = error_parts(PartsTwin(scenario, trace, "predicted_ttft"))
    assert [row["estimate"] for row in rows] == [label for label, _ in ESTIMATES]
    # the first row is the prediction error the benchmark reports for the same run
    plain = Twin(scenario, trace, "predicted_ttft").run()
    reported = stats.prediction_error(plain.outcomes)
    assert rows[0]["count"] == reported["count"] > 50
    assert round(rows[0]["p50_abs"], 4) == reported["p50_abs"]
    assert round(rows[0]["p90_abs"], 4) == reported["p90_abs"]
    # with the engine's wait and prefill step known, little error is left
    assert rows[-1]["p90_abs"] < rows[0]["p90_abs"] / 2
