"""The pure parts of the heartbeat loop: state, timing, and the heartbeat it builds."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from worker.engine_metrics import parse_metrics
from worker.heartbeat import (
    EngineView,
    WorkerIdentity,
    backoff_s,
    build_heartbeat,
    jittered,
    next_state,
)
from worker.probe import EngineVersion, ProbeResult, ServedModels
from worker.schema import Heartbeat, LifecycleState, Performance

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CAPTURE = (FIXTURES / "vllm-0.32-cpu-metrics.txt").read_text()
SAMPLE = parse_metrics(CAPTURE)
V032 = EngineVersion("0.32.0")
MODELS = ServedModels(("tiny-llama",), ("sql-lora",))
IDENTITY = WorkerIdentity("us-east-127.0.0.1-8000", "us-east", "http://127.0.0.1:8000", 256)

HEALTHY = ProbeResult(health_ok=True, metrics=SAMPLE, models=MODELS, version=V032)
UNHEALTHY = ProbeResult(health_ok=False, metrics=SAMPLE, models=MODELS, version=V032,
                        errors=("/health: HTTP 503",))
NO_METRICS = ProbeResult(health_ok=True, metrics=None, models=MODELS, version=V032,
                         errors=("/metrics: timed out",))
DOWN = ProbeResult(health_ok=False, metrics=None, models=None, version=None)

S = LifecycleState


@pytest.mark.parametrize(("current", "probe", "expected"), [
    (S.STARTING, DOWN, S.STARTING),
    (S.STARTING, UNHEALTHY, S.STARTING),
    (S.STARTING, HEALTHY, S.READY),
    (S.READY, HEALTHY, S.READY),
    (S.READY, UNHEALTHY, S.DEGRADED),
    (S.READY, NO_METRICS, S.DEGRADED),
    (S.DEGRADED, DOWN, S.DEGRADED),
    (S.DEGRADED, HEALTHY, S.READY),
])
def test_lifecycle(current: LifecycleState, probe: ProbeResult, expected: LifecycleState) -> None:
    view = EngineView().merge(probe)
    assert next_state(current, probe, view, draining=False) is expected


@pytest.mark.parametrize("probe", [HEALTHY, DOWN])
def test_draining_wins_over_everything(probe: ProbeResult) -> None:
    assert next_state(S.READY, probe, EngineView(), draining=True) is S.DRAINING


def test_not_ready_before_models_are_known() -> None:
    probe = ProbeResult(health_ok=True, metrics=SAMPLE, models=None, version=None)
    assert next_state(S.STARTING, probe, EngineView().merge(probe), draining=False) is S.STARTING


def test_view_keeps_what_a_failed_part_of_a_probe_did_not_report() -> None:
    view = EngineView().merge(HEALTHY).merge(DOWN)
    # kept for the heartbeat, but an engine that failed /health may have restarted since
    assert view == EngineView(SAMPLE, MODELS, V032, models_unconfirmed=True)


def test_jitter_stays_within_twenty_percent_and_varies() -> None:
    rng = random.Random(7)
    delays = [jittered(0.5, rng) for _ in range(1000)]
    assert min(delays) >= 0.4
    assert max(delays) <= 0.6
    assert max(delays) - min(delays) > 0.15


def test_backoff_doubles_and_is_capped() -> None:
    assert [backoff_s(n, 0.5, 4.0) for n in (1, 2, 3, 4, 50)] == [1.0, 2.0, 4.0, 4.0, 4.0]


def test_heartbeat_carries_the_engine_state_and_round_trips() -> None:
    perf = Performance(ttft_ms=85.0)
    beat = build_heartbeat(IDENTITY, EngineView().merge(HEALTHY), state=S.READY,
                           performance=perf, seq=3, sent_at_s=1_800_000_000.5, ttl_s=2.0)
    again = Heartbeat.from_json(beat.to_json())
    assert again == beat
    assert again.models == ("tiny-llama",)
    assert again.lora_adapters == ("sql-lora",)
    assert again.capacity.max_num_seqs == 256
    assert (again.capacity.kv_blocks_total, again.capacity.block_size_tokens) == (512, 128)
    assert again.engine.version == "0.32.0"
    assert again.engine.kind == "vllm"
    assert again.engine.kv_usage_metric == "vllm:kv_cache_usage_perc"
    assert again.performance.ttft_ms == 85.0


def test_heartbeat_before_any_scrape_has_zero_load_and_unknown_capacity() -> None:
    beat = build_heartbeat(IDENTITY, EngineView(), state=S.STARTING, performance=Performance(),
                           seq=0, sent_at_s=1.0, ttl_s=2.0)
    assert (beat.load.running, beat.load.waiting) == (0, 0)
    assert beat.capacity.kv_blocks_total is None
    assert beat.models == ()


def test_unknown_kv_usage_is_flagged_by_the_metric_name() -> None:
    no_kv = parse_metrics(
        "\n".join(line for line in CAPTURE.splitlines() if "kv_cache_usage" not in line)
    )
    probe = ProbeResult(health_ok=True, metrics=no_kv, models=MODELS, version=V032)
    beat = build_heartbeat(IDENTITY, EngineView().merge(probe), state=S.READY,
                           performance=Performance(), seq=0, sent_at_s=1.0, ttl_s=2.0)
    assert beat.engine.kv_usage_metric is None


def test_a_simulator_says_so_whatever_the_flag() -> None:
    probe = ProbeResult(health_ok=True, metrics=SAMPLE, models=MODELS,
                        version=EngineVersion("0.1.0", simulator=True))
    beat = build_heartbeat(IDENTITY, EngineView().merge(probe), state=S.READY,
                           performance=Performance(), seq=0, sent_at_s=1.0, ttl_s=2.0)
    assert (beat.engine.kind, beat.engine.version) == ("sim", "0.1.0")
