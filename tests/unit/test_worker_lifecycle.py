"""The agent against a misbehaving engine and host, without servers: negative gauges, a
huge body, a restarted engine, a flapping /health, a worker stuck starting, a wall clock
that steps back (the integration side is tests/integration/test_agent_adversary.py)."""

from __future__ import annotations

import itertools
import logging
import re
from pathlib import Path
from typing import cast

import aiohttp
import pytest

from worker.engine_metrics import MetricsFormatError, parse_metrics
from worker.heartbeat import HeartbeatLoop, HeartbeatTiming, WorkerIdentity
from worker.lifecycle import LOG_EVERY_S, EngineView, Lifecycle, Throttle, next_state
from worker.probe import BodyTooLargeError, ProbeResult, ServedModels, read_capped
from worker.schema import Heartbeat, LifecycleState

S = LifecycleState
CAPTURE = (Path(__file__).resolve().parents[1] / "fixtures" /
           "vllm-0.32-cpu-metrics.txt").read_text()
SAMPLE = parse_metrics(CAPTURE)
MODELS = ServedModels(("tiny-llama",), ())
UP = ProbeResult(health_ok=True, metrics=SAMPLE, models=MODELS, version=None)
DOWN = ProbeResult(health_ok=False, metrics=None, models=None, version=None,
                   errors=("/health: HTTP 503",))
NO_MODELS = ProbeResult(health_ok=True, metrics=SAMPLE, models=None, version=None,
                        errors=("/v1/models: HTTP 503",))
BAD_METRICS = ProbeResult(health_ok=True, metrics=None, models=MODELS, version=None,
                          errors=("/metrics: not Prometheus text",))


def with_value(name: str, value: float) -> str:
    pattern = re.compile(rf"^({re.escape(name)}(?:\{{[^}}]*\}})?) \S+$", re.MULTILINE)
    text, count = pattern.subn(lambda match: f"{match.group(1)} {value!r}", CAPTURE)
    assert count
    return text


# --- negative gauges ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["vllm:num_requests_running", "vllm:num_requests_waiting"])
def test_a_negative_request_count_is_a_format_error_not_an_idle_engine(name: str) -> None:
    with pytest.raises(MetricsFormatError, match=f"negative count of requests: {name} -3"):
        parse_metrics(with_value(name, -3.0))


def test_a_negative_kv_usage_is_unknown_like_nan() -> None:
    sample = parse_metrics(with_value("vllm:kv_cache_usage_perc", -0.5))
    assert sample.kv_cache_usage is None and sample.kv_usage_metric is None
    assert parse_metrics(with_value("vllm:kv_cache_usage_perc", 0.0)).kv_cache_usage == 0.0


# --- a huge body ----------------------------------------------------------------------------


class FakeBody:
    """An HTTP body arriving in chunks of at most `chunk` bytes; records the bytes read."""

    def __init__(self, size: int, chunk: int = 1000) -> None:
        self._left = size
        self._chunk = chunk
        self.read_bytes = 0

    async def read(self, n: int) -> bytes:
        take = min(n, self._chunk, self._left)
        self._left -= take
        self.read_bytes += take
        return b"x" * take


class FakeResponse:
    def __init__(self, size: int, declared: int | None) -> None:
        self.content = FakeBody(size)
        self.content_length = declared


async def read(size: int, declared: int | None, limit: int) -> tuple[bytes, int]:
    response = FakeResponse(size, declared)
    body = await read_capped(cast(aiohttp.ClientResponse, response), limit)
    return body, response.content.read_bytes


async def test_a_body_within_the_limit_is_read_whole() -> None:
    assert await read(5000, None, 5000) == (b"x" * 5000, 5000)
    assert await read(0, 0, 5000) == (b"", 0)


async def test_a_body_over_the_limit_is_refused_after_limit_plus_one_bytes() -> None:
    with pytest.raises(BodyTooLargeError, match="over 5000 bytes"):
        await read(9_000_000, None, 5000)
    response = FakeResponse(9_000_000, None)
    with pytest.raises(BodyTooLargeError):
        await read_capped(cast(aiohttp.ClientResponse, response), 5000)
    assert response.content.read_bytes == 5001


async def test_a_body_declared_over_the_limit_is_not_read_at_all() -> None:
    response = FakeResponse(9_000_000, 9_000_000)
    with pytest.raises(BodyTooLargeError, match="9000000 bytes"):
        await read_capped(cast(aiohttp.ClientResponse, response), 5000)
    assert response.content.read_bytes == 0


# --- a restarted engine ---------------------------------------------------------------------


def test_models_listed_before_a_failed_health_do_not_make_the_worker_ready() -> None:
    view = EngineView().merge(UP).merge(DOWN).merge(NO_MODELS)
    assert view.models == MODELS and view.models_unconfirmed
    assert next_state(S.DEGRADED, NO_MODELS, view, draining=False) is S.DEGRADED
    # a list given while /health fails may be the going engine's: still unconfirmed
    listed_while_failing = ProbeResult(health_ok=False, metrics=None, models=MODELS,
                                       version=None)
    assert EngineView().merge(UP).merge(listed_while_failing).models_unconfirmed
    confirmed = view.merge(UP)
    assert not confirmed.models_unconfirmed
    assert next_state(S.DEGRADED, UP, confirmed, draining=False) is S.READY


def test_a_failed_models_answer_alone_does_not_unconfirm_the_models() -> None:
    assert not EngineView().merge(UP).merge(NO_MODELS).models_unconfirmed


# --- hysteresis and the lines it logs ---------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def lifecycle(clock: Clock | None = None) -> Lifecycle:
    return Lifecycle("w", failures_to_degrade=2, window=4, goods_to_recover=3,
                     monotonic=clock or Clock())


def run(machine: Lifecycle, probes: list[ProbeResult], *,
        engine_down: bool = False) -> list[LifecycleState]:
    view = EngineView()
    states = []
    for probe in probes:
        view = view.merge(probe)
        states.append(machine.advance(probe, view, draining=False, engine_down=engine_down))
    return states


def test_an_alternating_engine_is_degraded_and_stays_so() -> None:
    states = run(lifecycle(), [UP] + [BAD_METRICS, UP] * 6)
    assert states[:4] == [S.READY, S.READY, S.READY, S.DEGRADED]
    assert set(states[3:]) == {S.DEGRADED}


def test_a_degraded_worker_needs_three_good_probes_in_a_row() -> None:
    machine = lifecycle()
    assert run(machine, [UP, BAD_METRICS, BAD_METRICS, UP, UP, BAD_METRICS, UP, UP, UP]) == [
        S.READY, S.READY, S.DEGRADED, S.DEGRADED, S.DEGRADED, S.DEGRADED, S.DEGRADED,
        S.DEGRADED, S.READY]
    # back to ready, it is forgiven one failure again (the window began anew)
    assert run(machine, [BAD_METRICS, UP, UP, UP]) == [S.READY] * 4


def test_the_first_ready_needs_one_good_probe_and_a_drain_or_a_down_process_wins() -> None:
    assert run(lifecycle(), [DOWN, DOWN, UP]) == [S.STARTING, S.STARTING, S.READY]
    machine = lifecycle()
    run(machine, [UP])
    assert run(machine, [UP], engine_down=True) == [S.DEGRADED]
    view = EngineView().merge(UP)
    assert machine.advance(UP, view, draining=True, engine_down=False) is S.DRAINING


def test_forgiven_failures_and_a_stuck_start_are_logged_once_per_period(
    caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="worker")
    clock = Clock()
    machine = lifecycle(clock)
    run(machine, [BAD_METRICS] * 5)
    clock.now = LOG_EVERY_S
    run(machine, [BAD_METRICS])
    starting = [r.getMessage() for r in caplog.records if "still starting" in r.getMessage()]
    assert starting == ["worker w: still starting (/metrics: not Prometheus text)"] * 2
    caplog.clear()
    run(machine, [UP])
    for _ in range(10):  # one failure in each window of four: forgiven every time
        run(machine, [BAD_METRICS, UP, UP, UP])
    forgiven = [r.getMessage() for r in caplog.records if "still ready" in r.getMessage()]
    assert len(forgiven) == 1 and "2 of the last 4 probes" in forgiven[0], forgiven
    clock.now += LOG_EVERY_S
    run(machine, [BAD_METRICS])
    forgiven = [r.getMessage() for r in caplog.records if "still ready" in r.getMessage()]
    assert len(forgiven) == 2 and "(9 more forgiven" in forgiven[1], forgiven


def test_throttle() -> None:
    clock = Clock()
    throttle = Throttle(10.0, clock)
    assert [throttle.due(), throttle.due()] == [True, False]
    clock.now = 10.0
    assert throttle.due() and throttle.skipped == 1
    throttle.reset()
    assert throttle.due()


# --- a wall clock that steps back -------------------------------------------------------------


class Scripted:
    async def probe(self) -> ProbeResult:
        return UP


class Collected:
    def __init__(self) -> None:
        self.heartbeats: list[Heartbeat] = []

    async def publish(self, heartbeat: Heartbeat) -> None:
        self.heartbeats.append(heartbeat)


async def test_sent_at_never_goes_back_within_one_agent(
    caplog: pytest.LogCaptureFixture
) -> None:
    wall = [1000.0]
    published = Collected()
    loop = HeartbeatLoop(WorkerIdentity("w", "us-east", "http://127.0.0.1:1", 4), Scripted(),
                         published, HeartbeatTiming(interval_s=0.1, ttl_s=1.0),
                         wall_clock=lambda: wall[0])
    for now in (1000.0, 1000.0, 400.0, 400.5, 1000.5, 2000.0):
        wall[0] = now
        await loop.beat()
    sent = [hb.sent_at_s for hb in published.heartbeats]
    assert sent == pytest.approx([1000.0, 1000.001, 1000.002, 1000.003, 1000.5, 2000.0])
    assert all(a < b for a, b in itertools.pairwise(sent))
    stepped = [r for r in caplog.records if "stepped back" in r.getMessage()]
    assert len(stepped) == 1, "one line per step back, not one per beat"

