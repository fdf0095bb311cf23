"""`globalpool bench-batch`, tiny: the command runs its three phases on a real local stack
and writes a report whose every part is there, with every batch line answered once.

The numbers of so short a run mean little (the goals are checked by the full run,
BENCHMARKS.md); this checks that the bench measures what it says it does.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from lab.batchbench.capacity import EngineSpeed
from lab.devstack.valkey import free_port
from lab.sim.clock import VirtualClock
from lab.sim.config import SimConfig
from lab.sim.engine import Engine
from lab.sim.tokens import prompt_from_text
from tests.conftest import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

PRICES = {"cheap": 1.0, "middle": 2.0, "dear": 4.0}
LINES = 40


def _config(tmp_path: Path) -> Path:
    pool = {"workers": 1, "max_num_seqs": 8, "decode_step_ms": 5}
    document: dict[str, Any] = {
        "apiVersion": "globalpool/v1",
        "redis": {"url": "embedded", "key_prefix": f"gp-{tmp_path.name[-12:]}"},
        "router": {"region": "middle", "host": "127.0.0.1", "port": free_port()},
        "heartbeat": {"interval_s": 0.2, "ttl_s": 1.0},
        "regions": {name: {"models": ["tiny-llama"], "cost_per_gpu_hour": price,
                           "rtt_ms": {other: 20 for other in PRICES if other != name},
                           "simulated": pool} for name, price in PRICES.items()},
    }
    path = tmp_path / "regions.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


@pytest.mark.slow(why="a tiny bench-batch run (~25 s)")
def test_a_tiny_run_reports_every_part(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "router.cli", "bench-batch", "--quick", "--out", str(out),
         "--config", str(_config(tmp_path)), "--lines", str(LINES), "--calibration-lines",
         "20", "--baseline-s", "3", "--rate", "6", "--interactive-max-tokens", "8",
         "--batch-max-tokens", "8", "--batch-timeout-s", "40"],
        cwd=ROOT, capture_output=True, text=True, timeout=85)
    assert result.returncode in (0, 3), result.stderr[-3000:] + result.stdout[-3000:]
    assert "[with_batch] batch batch_" in result.stdout  # progress is printed
    assert "goal " in result.stdout  # and the summary
    for name in ("results.json", "timeline.json", "batch.png", "summary.md"):
        assert (out / name).stat().st_size > 0, name
    report = json.loads((out / "results.json").read_text())
    assert result.returncode == (0 if report["goals_met"] else 3)

    batch = report["batch"]
    assert batch["every_line_completed"], batch
    assert (batch["answered_ok"], batch["missing_custom_ids"]) == (LINES, 0)
    assert batch["request_counts"] == {"total": LINES, "completed": LINES, "failed": 0}
    assert batch["tokens"]["completion_mean"] == 8
    order = batch["price_order"]["regions"]
    assert [row["region"] for row in order] == ["cheap", "middle", "dear"]
    assert sum(row["lines"] for row in order) == LINES  # /metrics counted each line once
    assert batch["throughput"]["ran_lines_per_s"] > 0
    assert report["calibration"]["status"] == "completed"

    for phase in ("baseline", "with_batch"):
        assert report[phase]["requests"] > 0 and report[phase]["failed"] == 0
        assert set(report[phase]["ttft_ms"]) == {"p50", "p90", "p99"}
        assert report[phase]["ttft_ms"]["p99"] is not None
    assert set(report["ttft_ratio"]) == {"p50", "p90", "p99"}
    spare = report["spare_capacity"]
    assert spare["model_lines_per_s"] > 0 and spare["batch_slots"] == 3 * 6
    assert {w["worker"] for w in spare["workers"]} == {"cheap-1", "middle-1", "dear-1"}
    assert [goal["met"] in (True, False) for goal in report["goals"]] == [True] * 4
    assert set(report["diagnosis"]) == {"mean_sequences_per_worker", "decode_step_ms_model",
                                        "full_worker_looks", "slow_requests"}
    assert report["exited_children"] == []


async def test_the_spare_capacity_model_is_the_simulators_own_arithmetic() -> None:
    """The denominator of the throughput goal: a line's time in its slot as
    lab.batchbench.capacity predicts it, against the simulator's engine in virtual time
    running the 12 batch slots of a 16-slot worker full of 64-token lines."""
    config = SimConfig(served_model_names=("tiny-llama",), max_num_seqs=16,
                       prefill_tokens_per_s=8000.0, decode_step_ms=15.0,
                       decode_step_ms_per_seq=0.5)
    speed = EngineSpeed(16, 15.0, 0.5, 8000.0)
    engine = Engine(config, VirtualClock())
    prompt = prompt_from_text("Summarize document 7 of tonight's batch, please." * 2,
                              config.block_size, config.seed)
    lines = [engine.submit(f"line-{i}", prompt, 64, ignore_eos=True)
             for i in range(speed.batch_slots)]
    running = asyncio.create_task(engine.run())
    try:
        await asyncio.gather(*(line.wait_finished() for line in lines))
    finally:
        running.cancel()
    measured_s = max(line.finished_s or 0.0 for line in lines)
    predicted_s = speed.request_s(speed.batch_slots, prompt.num_tokens, 64)
    assert speed.batch_slots == 12
    # The model leaves out the other lines' prefill in the shared first step (~3 %).
    assert predicted_s <= measured_s <= 1.05 * predicted_s, (measured_s, predicted_s)
