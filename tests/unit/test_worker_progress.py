"""A wedged engine, found by its agent: requests held and no engine step for
`stuck_after_s` (worker.progress), and what the heartbeat says then (the processes are in
tests/integration/test_hung_workers.py and the real-vLLM tier)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from tests.unit.test_worker_lifecycle import Collected
from worker.engine_metrics import MetricsSample, parse_metrics
from worker.heartbeat import HeartbeatLoop, HeartbeatTiming, WorkerIdentity
from worker.load_records import static_digest
from worker.probe import ProbeResult, ServedModels
from worker.progress import STEP_COUNT, ProgressWatch, steps_of
from worker.schema import MAX_STUCK_S, Heartbeat, LifecycleState, Refused, parse_heartbeat
from worker.signing import HeartbeatSigner, verify_payload, verify_signature

CAPTURE = (Path(__file__).resolve().parents[1] / "fixtures" /
           "vllm-0.32-cpu-metrics.txt").read_text()
MODELS = ServedModels(("tiny-llama",), ())
# The capture without anything that moves as the engine steps.
NO_PROGRESS_COUNT = "\n".join(line for line in CAPTURE.splitlines()
                              if not line.startswith(("vllm:iteration_tokens_total",
                                                      "vllm:prompt_tokens_total",
                                                      "vllm:generation_tokens_total")))


def metrics(*, steps: float | None = 1223.0, running: int = 0, waiting: int = 0,
            text: str = CAPTURE) -> MetricsSample:
    """The real capture of vLLM 0.32's /metrics with these values (`steps`: the step
    histogram's count; None: the histogram left out)."""
    values: dict[str, float] = {"vllm:num_requests_running": running,
                                "vllm:num_requests_waiting": waiting}
    if steps is not None:
        values[STEP_COUNT] = steps
    for name, value in values.items():
        pattern = re.compile(rf"^({re.escape(name)}\{{[^}}]*\}}) \S+$", re.MULTILINE)
        text, count = pattern.subn(rf"\g<1> {float(value)!r}", text)
        assert count == 1, name
    if steps is None:
        text = "\n".join(line for line in text.splitlines()
                         if not line.startswith("vllm:iteration_tokens_total"))
    return parse_metrics(text)


def test_the_step_count_is_read_from_a_real_capture_or_else_the_token_counters() -> None:
    assert steps_of(parse_metrics(CAPTURE)) == 1223.0  # vllm:iteration_tokens_total_count
    assert steps_of(metrics(steps=None)) == 8069.0 + 14400.0  # prompt + generation tokens
    assert steps_of(parse_metrics(NO_PROGRESS_COUNT)) is None


def every_half_second(watch: ProgressWatch, sample: MetricsSample, from_s: float,
                      to_s: float) -> list[float | None]:
    """What `watch` says of `sample` observed every 0.5 s from `from_s` to `to_s`."""
    return [watch.observe(sample, from_s + tick / 2)
            for tick in range(round((to_s - from_s) * 2) + 1)]


def test_an_engine_holding_requests_without_a_step_is_stuck_after_the_threshold() -> None:
    watch = ProgressWatch(stuck_after_s=15.0)
    held = metrics(running=3, waiting=2)
    said = every_half_second(watch, held, 0.0, 40.0)
    assert said[:30] == [None] * 30  # 0 to 14.5 s
    assert said[30:] == [tick / 2 for tick in range(30, 81)]  # 15.0 s, 15.5 s, ... 40 s
    # One step, and it is not stuck; it counts again from there.
    stepped = metrics(steps=1224.0, running=3, waiting=2)
    said = every_half_second(watch, stepped, 40.5, 55.5)
    assert said[:-1] == [None] * 30 and said[-1] == 15.0


def test_a_stall_of_the_whole_host_is_not_taken_for_the_engines() -> None:
    # Nothing ran for 13 s, this agent included: the gap counts as 2 s, not 13.
    watch = ProgressWatch(stuck_after_s=15.0, max_gap_s=2.0)
    held = metrics(running=3)
    assert every_half_second(watch, held, 0.0, 1.0) == [None] * 3
    assert watch.observe(held, 14.0) is None  # 1 + 2 s held, as far as it knows
    said = every_half_second(watch, held, 14.5, 40.0)
    # 15 s at 26.0 s: 1 s before the stall, 2 for it, 12 after it (without the cap it
    # would have said 15 s at 15.0 s)
    assert said.index(15.0) == (26.0 - 14.5) * 2


def test_an_idle_engine_is_never_stuck_and_its_wait_starts_when_it_holds_requests() -> None:
    watch = ProgressWatch(stuck_after_s=15.0)
    idle = metrics(running=0, waiting=0)
    assert set(every_half_second(watch, idle, 0.0, 3600.0)) == {None}
    # Requests arrive, counted as waiting, and no step runs: stuck 15 s after it was
    # last seen idle.
    said = every_half_second(watch, metrics(running=0, waiting=4), 3600.5, 3615.0)
    assert said[:-1] == [None] * 29 and said[-1] == 15.0


def test_a_restarted_engine_counting_from_zero_is_movement_and_a_day_is_the_most_said() -> None:
    watch = ProgressWatch(stuck_after_s=1.0, max_gap_s=1e12)
    assert watch.observe(metrics(running=1), 0.0) is None
    assert watch.observe(metrics(running=1), 2.0) == 2.0
    assert watch.observe(metrics(steps=3.0, running=1), 3.0) is None  # a new engine
    assert watch.observe(metrics(steps=3.0, running=1), 1e9) == MAX_STUCK_S


def test_an_engine_without_any_progress_count_is_never_called_stuck() -> None:
    held = metrics(steps=None, running=5, text=NO_PROGRESS_COUNT + "\n")
    watch = ProgressWatch(stuck_after_s=1.0)
    assert [watch.observe(held, now) for now in (0.0, 10.0, 1000.0)] == [None] * 3


def data_parallel_text(engines: list[tuple[int, float]]) -> str:
    """The capture as a data-parallel server shows it: each series once per engine (vLLM
    labels them `engine="0"`, `engine="1"`, ...), with each engine's (requests running,
    steps counted); none waiting."""
    lines: list[str] = []
    for line in CAPTURE.splitlines():
        lines.extend(line.replace('engine="0"', f'engine="{index}"')
                     for index in range(len(engines) if 'engine="0"' in line else 1))
    text = "\n".join(lines) + "\n"
    for index, (running, steps) in enumerate(engines):
        for name, value in ((STEP_COUNT, steps), ("vllm:num_requests_running", running),
                            ("vllm:num_requests_waiting", 0)):
            pattern = re.compile(
                rf'^({re.escape(name)}\{{engine="{index}"[^}}]*\}}) \S+$', re.MULTILINE)
            text, count = pattern.subn(rf"\g<1> {float(value)!r}", text)
            assert count == 1, (name, index)
    return text


def two_engines(steps: tuple[float, float], running: tuple[int, int]) -> MetricsSample:
    """The capture as a data-parallel server of two engines shows it, with these step
    counts and requests."""
    return parse_metrics(data_parallel_text(list(zip(running, steps, strict=True))))


def test_each_engine_behind_one_server_is_judged_by_its_own_steps() -> None:
    sample = two_engines((100.0, 200.0), (3, 2))
    assert set(sample.engines) == {"0", "1"} and sample.running == 5
    assert sample.engine_count == 2 and parse_metrics(CAPTURE).engine_count == 1
    assert sample.kv_blocks_total == 2 * parse_metrics(CAPTURE).kv_blocks_total  # type: ignore[operator]
    assert sample.engines["1"][STEP_COUNT] == 200.0
    watch = ProgressWatch(stuck_after_s=15.0)
    # Engine 0 steps, engine 1 holds two requests and does not: their sums still move.
    said = [watch.observe(two_engines((100.0 + tick, 200.0), (3, 2)), tick / 2)
            for tick in range(41)]
    assert said[:30] == [None] * 30 and said[30:] == [tick / 2 for tick in range(30, 41)]
    # Engine 1 idle: it runs no step and is not stuck, whatever engine 0 does.
    watch = ProgressWatch(stuck_after_s=15.0)
    assert {watch.observe(two_engines((100.0 + tick, 200.0), (3, 0)), tick / 2)
            for tick in range(41)} == {None}
    # Both stepping: never stuck.
    watch = ProgressWatch(stuck_after_s=15.0)
    assert {watch.observe(two_engines((100.0 + tick, 200.0 + tick), (3, 2)), tick / 2)
            for tick in range(41)} == {None}


def test_a_body_that_does_not_tell_its_engines_apart_is_judged_by_its_sums() -> None:
    assert set(parse_metrics(CAPTURE).engines) == {"0"}
    unlabelled = re.sub(r'\{engine="0",model_name="tiny-llama"\}', "", CAPTURE)
    assert "engine=" not in unlabelled.split("vllm:num_requests_running")[1].split("\n")[0]
    sample = parse_metrics(unlabelled)
    assert sample.engines == {} and steps_of(sample) == 1223.0
    watch = ProgressWatch(stuck_after_s=1.0)
    held = parse_metrics(unlabelled.replace("vllm:num_requests_running 0.0",
                                            "vllm:num_requests_running 2.0"))
    assert [watch.observe(held, now) for now in (0.0, 0.5, 1.0)] == [None, None, 1.0]


# --- the agent ------------------------------------------------------------------------------


class Engine:
    """What /health, /metrics and /v1/models answer: the capture, with `sample`'s values."""

    def __init__(self) -> None:
        self.sample = metrics()

    async def probe(self) -> ProbeResult:
        return ProbeResult(health_ok=True, metrics=self.sample, models=MODELS, version=None)


async def test_the_agent_says_degraded_at_once_when_stuck_and_ready_after_three_steps(
    caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="worker")
    clock = [0.0]
    engine, published = Engine(), Collected()
    loop = HeartbeatLoop(WorkerIdentity("w", "us-east", "http://127.0.0.1:1", 4), engine,
                         published, HeartbeatTiming(interval_s=0.5, ttl_s=2.0,
                                                    stuck_after_s=15.0),
                         monotonic=lambda: clock[0], wall_clock=lambda: 1e9 + clock[0])

    async def beat_at(now_s: float) -> Heartbeat:
        clock[0] = now_s
        return (await loop.beat()).heartbeat

    assert (await beat_at(0.0)).state is LifecycleState.READY
    engine.sample = metrics(running=4, waiting=1)  # wedged with 5 requests in it
    for tick in range(1, 30):  # every 0.5 s, to 14.5 s
        assert (await beat_at(tick / 2)).state is LifecycleState.READY
    stuck = await beat_at(15.0)
    # At once: no "two failed probes of four" first (it has waited 15 s already).
    assert stuck.state is LifecycleState.DEGRADED
    assert stuck.engine.stuck_for_s == 15.0
    assert stuck.condition() == ("degraded: its engine has run no step for 15 s while "
                                 "holding requests")
    transition = [r.getMessage() for r in caplog.records if "ready -> degraded" in r.getMessage()]
    assert transition == ["worker w: ready -> degraded (the engine has run no step for 15 s "
                          "while holding 4 running and 1 waiting requests (a wedged "
                          "accelerator?))"]
    for tick in range(31, 60):
        await beat_at(tick / 2)
    assert (await beat_at(30.0)).engine.stuck_for_s == 30.0
    # It steps again: no longer stuck at once, and ready after three good probes in a row.
    engine.sample = metrics(steps=1300.0, running=4, waiting=1)
    states = []
    for now_s in (30.5, 31.0, 31.5):
        beat = await beat_at(now_s)
        engine.sample = metrics(steps=1300.0 + now_s, running=4, waiting=1)
        assert beat.engine.stuck_for_s is None
        states.append(beat.state)
    assert states == [LifecycleState.DEGRADED, LifecycleState.DEGRADED, LifecycleState.READY]


def test_a_heartbeat_says_stuck_only_when_stuck_and_older_routers_read_the_others() -> None:
    base = parse_heartbeat(json.dumps({
        "worker_id": "w", "region": "us-east", "endpoint": "http://127.0.0.1:1",
        "models": ["m"], "state": "ready", "capacity": {"max_num_seqs": 4},
        "load": {"running": 0, "waiting": 0, "kv_cache_usage": None},
        "seq": 1, "sent_at_s": 1e9, "ttl_s": 2.0}))
    # Not stuck: the JSON has no such key, so a router that predates it (which refuses an
    # unknown field) reads it, and its static digest is the one such a router computes.
    assert "stuck_for_s" not in base.to_json()
    assert parse_heartbeat(base.to_json()) == base
    stuck = base.model_copy(update={
        "state": LifecycleState.DEGRADED,
        "engine": base.engine.model_copy(update={"stuck_for_s": 15.0})})
    assert json.loads(stuck.to_json())["engine"]["stuck_for_s"] == 15.0
    assert parse_heartbeat(stuck.to_json()) == stuck
    # The digest says whether it is stuck, not for how long (each beat's value differs).
    longer = stuck.model_copy(update={
        "engine": stuck.engine.model_copy(update={"stuck_for_s": 40.0})})
    degraded = stuck.model_copy(update={
        "engine": stuck.engine.model_copy(update={"stuck_for_s": None})})
    assert static_digest(stuck) == static_digest(longer) != static_digest(degraded)
    # Signed either way, and checked either way.
    signer = HeartbeatSigner("k", b"s" * 32)
    for heartbeat in (base, stuck):
        signed, payload = signer.signed_payload(heartbeat)
        assert verify_signature(signed, {"k": b"s" * 32}) is None
        assert verify_payload(payload, parse_heartbeat(payload), {"k": b"s" * 32}) is None


@pytest.mark.parametrize("value", [-1.0, MAX_STUCK_S * 2, float("nan"), "15", True])
def test_an_absurd_stuck_time_is_refused(value: object) -> None:
    document = {
        "worker_id": "w", "region": "us-east", "endpoint": "http://127.0.0.1:1",
        "models": ["m"], "state": "degraded", "capacity": {"max_num_seqs": 4},
        "load": {"running": 0, "waiting": 0, "kv_cache_usage": None},
        "engine": {"stuck_for_s": value}, "seq": 1, "sent_at_s": 1e9, "ttl_s": 2.0}
    with pytest.raises(Refused) as refused:
        parse_heartbeat(json.dumps(document))
    assert refused.value.reason == "invalid:engine.stuck_for_s", refused.value
