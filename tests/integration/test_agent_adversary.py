"""The worker agent attacked as a misbehaving engine, host and network would attack it.

Each test drives the real agent (in-process `HeartbeatLoop`/`WorkerAgent`, or the CLI in a
subprocess) against a real loopback HTTP engine (`Hostile`, a knobbed vLLM 0.32 stand-in,
or the simulator as a launched engine), a real Valkey, and, where the question is whether
routers stop sending, a real router app whose snapshot is read. What is already covered in
test_worker_agent.py / test_worker_launch.py (a Redis stop/start, a crash and restart, an
engine that never answers /health) is not repeated. A test marked xfail(strict) asserts the
correct behaviour of a fault found here; its reason says what and where.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web

from lab.devstack.valkey import EmbeddedValkey
from lab.devstack.valkey import free_port as free_valkey_port
from router.app import HOLDER, RouterSettings, build_app
from router.config_loader import load_config
from tests.conftest import skip_unless_slow_tests_are_asked_for
from tests.integration.test_worker_agent import (
    CAPTURE,
    EngineStandIn,
    assert_clean_exit,
    finish,
    heartbeat_loop,
    is_state,
    reader,
    start_worker,
    subscribed,
    wait_for_key,
    with_values,
)
from tests.integration.test_worker_launch import alive, engine_pid, free_port, start_agent
from worker.agent import WorkerAgent
from worker.heartbeat import HeartbeatLoop, HeartbeatTiming, WorkerIdentity
from worker.heartbeat_keys import HeartbeatKeys
from worker.probe import EngineProber, open_engine_session
from worker.publisher import HeartbeatPublisher, RedisUnavailableError
from worker.redis_client import connect
from worker.schema import MAX_SEQS, Heartbeat, LifecycleState

# The slow tier (`pytest -m slow`): ~35 s of agents, engines and Valkey misbehaving,
# which the default run's 15 minutes cannot spare.
pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(autouse=True)
def _slow_tier(request: pytest.FixtureRequest) -> None:
    skip_unless_slow_tests_are_asked_for(request.config, "hostile engines, hosts and "
                                                         "Redis, ~35 s in all")

ROOT = Path(__file__).resolve().parents[2]
WORKER = "us-east-test-1"
TIMING = HeartbeatTiming(interval_s=0.1, ttl_s=0.5, max_backoff_s=0.4)


class Hostile(EngineStandIn):
    """The vLLM 0.32 stand-in with more knobs: a /metrics body of our own (`metrics_body`),
    /metrics or /health that never answer (`hang`), a /health decided per request
    (`health_now`), and /v1/models that names another model or fails (`models`)."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics_body: str | None = None
        self.hang: set[str] = set()
        self.health_now: Callable[[], bool] | None = None
        self.models: list[str] | None = ["tiny-llama"]
        self._release = asyncio.Event()  # set at stop: hung handlers end, cleanup is quick

    async def stop(self) -> None:
        self._release.set()
        await super().stop()

    async def _health(self, request: web.Request) -> web.Response:
        if "/health" in self.hang:
            await self._release.wait()
        if self.health_now is not None:
            return web.Response(status=200 if self.health_now() else 503)
        return await super()._health(request)

    async def _metrics(self, request: web.Request) -> web.Response:
        if "/metrics" in self.hang:
            await self._release.wait()
        if self.metrics_body is not None:
            return web.Response(text=self.metrics_body, content_type="text/plain")
        return await super()._metrics(request)

    async def _models(self, request: web.Request) -> web.Response:
        if self.models is None:
            return web.Response(status=503, text="loading")
        return web.json_response({"object": "list", "data": [
            {"id": name, "object": "model", "parent": None} for name in self.models]})


@pytest.fixture
async def engine() -> AsyncIterator[Hostile]:
    stand_in = Hostile()
    await stand_in.start()
    yield stand_in
    await stand_in.stop()


def gauges(**values: float) -> str:
    """The real capture with vLLM's load gauges set (running, waiting, kv usage)."""
    names = {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
             "kv": "vllm:kv_cache_usage_perc"}
    return with_values(CAPTURE, {names[k]: v for k, v in values.items()})


async def ready_loop(loop: HeartbeatLoop) -> Heartbeat:
    for _ in range(5):
        beat = await loop.beat()
        if beat.heartbeat.state is LifecycleState.READY:
            return beat.heartbeat
    raise AssertionError("the agent never said ready")


# --- a hostile /metrics and /health -------------------------------------------------------


async def test_hung_metrics_delays_a_beat_by_the_probe_timeout_at_most_then_degrades(
    engine: Hostile, redis_url: str, key_prefix: str
) -> None:
    keys = HeartbeatKeys(key_prefix)
    async with heartbeat_loop(engine.url, redis_url, keys, timing=TIMING) as (loop, _):
        await ready_loop(loop)
        engine.hang = {"/metrics"}
        took, states = [], []
        for _ in range(3):
            started = time.monotonic()
            beat = await loop.beat()
            took.append(time.monotonic() - started)
            states.append(beat.heartbeat.state)
            assert beat.published
    # heartbeat_loop's probe timeout is 0.3 s; a hung endpoint costs no more per beat.
    assert max(took) < 0.3 + 0.4, took
    assert states[0] is LifecycleState.READY, "one late answer is forgiven"
    assert states[1:] == [LifecycleState.DEGRADED] * 2, states


async def test_a_huge_metrics_body_is_refused_without_blocking_the_agent(
    engine: Hostile, redis_url: str, key_prefix: str
) -> None:
    junk = "".join(f'vllm:junk_total{{i="{i}"}} 1\n' for i in range(300_000))
    engine.metrics_body = CAPTURE + "# TYPE vllm:junk_total counter\n" + junk
    assert len(engine.metrics_body) > 8_000_000
    keys = HeartbeatKeys(key_prefix)
    gaps: list[float] = []

    async def ticker() -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.02)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    async with heartbeat_loop(engine.url, redis_url, keys, timing=TIMING) as (loop, _):
        ticking = asyncio.create_task(ticker())
        started = time.monotonic()
        beat = await loop.beat()
        took = time.monotonic() - started
        ticking.cancel()
        await asyncio.gather(ticking, return_exceptions=True)
    assert max(gaps, default=0.0) < 0.25, f"event loop blocked {max(gaps):.2f} s"
    assert took < 0.3 + 0.4, f"one beat took {took:.2f} s"
    assert beat.heartbeat.state is not LifecycleState.READY


async def test_garbage_nan_inf_huge_and_duplicated_samples_never_advertise_capacity(
    engine: Hostile, redis_url: str, key_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="worker")
    keys = HeartbeatKeys(key_prefix)
    running_line = 'vllm:num_requests_running{engine="0",model_name="tiny-llama"}'
    cases: list[tuple[str, str, Callable[[Heartbeat], bool]]] = [
        ("garbage", "<html>502 Bad Gateway</html>\x00\xff{{{",
         lambda hb: hb.state is LifecycleState.DEGRADED),
        ("NaN running", gauges(running=float("nan")),
         lambda hb: hb.state is LifecycleState.DEGRADED),
        ("+Inf waiting", gauges(waiting=float("inf")),
         lambda hb: hb.state is LifecycleState.DEGRADED),
        ("huge running", gauges(running=1e300, waiting=1e18),
         lambda hb: hb.load.running == MAX_SEQS and hb.load.waiting == MAX_SEQS),
        ("kv over 1", gauges(kv=7.5), lambda hb: hb.load.kv_cache_usage == 1.0),
        ("NaN kv", gauges(kv=float("nan")),
         lambda hb: hb.load.kv_cache_usage is None and hb.engine.kv_usage_metric is None),
        ("duplicated series", gauges(running=5.0) + f"{running_line} 5.0\n",
         lambda hb: hb.load.running >= 5),
    ]
    async with heartbeat_loop(engine.url, redis_url, keys, timing=TIMING) as (loop, _):
        failures = []
        for name, body, ok in cases:
            engine.metrics_body = None
            await ready_loop(loop)
            engine.metrics_body = body
            beats = [(await loop.beat()).heartbeat for _ in range(2)]
            if not ok(beats[-1]):
                failures.append((name, beats[-1].state, beats[-1].load))
    assert failures == []
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("/metrics: not Prometheus text" in m for m in said), said
    assert any("vllm:num_requests_running or vllm:num_requests_waiting missing" in m
               for m in said), said


async def test_negative_gauges_do_not_advertise_an_idle_engine(
    engine: Hostile, redis_url: str, key_prefix: str
) -> None:
    keys = HeartbeatKeys(key_prefix)
    async with heartbeat_loop(engine.url, redis_url, keys, timing=TIMING) as (loop, _):
        await ready_loop(loop)
        engine.metrics_body = gauges(running=-3.0, waiting=-1.0, kv=-0.5)
        beats = [(await loop.beat()).heartbeat for _ in range(2)]
    last = beats[-1]
    assert last.state is not LifecycleState.READY or last.load.kv_cache_usage is None, (
        last.state, last.load)


async def test_a_model_switch_mid_run_is_published_at_once(
    engine: Hostile, redis_url: str, key_prefix: str
) -> None:
    keys = HeartbeatKeys(key_prefix)
    async with heartbeat_loop(engine.url, redis_url, keys, timing=TIMING) as (loop, _):
        before = await ready_loop(loop)
        engine.models = ["other-model"]
        after = (await loop.beat()).heartbeat
    assert before.models == ("tiny-llama",)
    assert after.models == ("other-model",) and after.state is LifecycleState.READY


async def test_an_engine_back_from_a_restart_is_not_advertised_with_its_old_models(
    engine: Hostile, redis_url: str, key_prefix: str
) -> None:
    keys = HeartbeatKeys(key_prefix)
    async with heartbeat_loop(engine.url, redis_url, keys, timing=TIMING) as (loop, _):
        await ready_loop(loop)
        engine.healthy = False  # restarting
        for _ in range(2):
            await loop.beat()
        engine.models = None  # the new engine's model list is not served yet
        engine.healthy = True
        # several beats: recovering takes good probes in a row, and none of them may
        # advertise the models of the engine that went away
        back = [(await loop.beat()).heartbeat for _ in range(5)]
    assert all(hb.state is not LifecycleState.READY or hb.models != ("tiny-llama",)
               for hb in back), back


async def test_a_flapping_health_is_not_advertised_ready(
    engine: Hostile, redis_url: str, key_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="worker")
    keys = HeartbeatKeys(key_prefix)
    async with heartbeat_loop(engine.url, redis_url, keys, timing=TIMING) as (loop, _):
        await ready_loop(loop)
        engine.health_now = lambda: int(time.monotonic() / 0.1) % 2 == 0
        task = asyncio.create_task(loop.run())
        await asyncio.sleep(0.8)
        seen: list[LifecycleState] = []
        for _ in range(75):
            seen.append(loop.state)
            await asyncio.sleep(0.02)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    ready = seen.count(LifecycleState.READY) / len(seen)
    flips = [r for r in caplog.records if "-> degraded" in r.getMessage()]
    assert ready <= 0.3 and len(flips) <= 2, (
        f"READY {ready:.0%} of the time, {len(flips)} ready->degraded flips in 1.5 s")


async def test_a_worker_stuck_starting_says_why(
    engine: Hostile, redis_url: str, key_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="worker")
    engine.metrics_body = "this is not prometheus {"
    keys = HeartbeatKeys(key_prefix)
    async with heartbeat_loop(engine.url, redis_url, keys, timing=TIMING) as (loop, _):
        states = [(await loop.beat()).heartbeat.state for _ in range(6)]
    assert set(states) == {LifecycleState.STARTING}
    said = [r.getMessage() for r in caplog.records]
    assert any("/metrics" in m for m in said), said


# --- a hostile Redis ------------------------------------------------------------------------


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def fresh_key_within(url: str, key: str, after_seq: int, timeout_s: float) -> float:
    """Seconds until `key` holds a heartbeat with a seq above `after_seq`."""
    started = time.monotonic()
    async with reader(url) as redis:
        async with asyncio.timeout(timeout_s):
            while True:
                try:
                    raw = await redis.get(key)
                except Exception:  # the server may be coming up
                    raw = None
                if isinstance(raw, bytes) and Heartbeat.from_json(raw).seq > after_seq:
                    return time.monotonic() - started
                await asyncio.sleep(0.05)


async def test_redis_down_at_start_hung_full_and_emptied_the_agent_recovers_alone(
    engine: Hostile, key_prefix: str, tmp_path: Path
) -> None:
    port = free_valkey_port()
    url = f"redis://127.0.0.1:{port}/0"
    key = HeartbeatKeys(key_prefix).worker("w1")
    agent, _ = await start_worker(
        "--region", "us-east", "--engine-url", engine.url, "--worker-id", "w1",
        "--redis-url", url, "--key-prefix", key_prefix, "--interval-s", "0.2",
        "--ttl-s", "1.0", "--drain-timeout-s", "2")
    server: EmbeddedValkey | None = None
    try:
        # 1. Redis down at start: the agent waits, quietly and cheaply.
        await asyncio.sleep(0.5)
        cpu0, rss0 = cpu_s(agent.pid), rss_mb(agent.pid)
        await asyncio.sleep(2.0)
        idle_cpu = (cpu_s(agent.pid) - cpu0) / 2.0
        assert agent.returncode is None
        server = EmbeddedValkey.start(port=port, workdir=tmp_path)
        first_s = await fresh_key_within(url, key, -1, timeout_s=4)
        # 2. Redis hung (SIGSTOP) for 3 s, then back.
        async with reader(url) as redis:
            seq = Heartbeat.from_json(await wait_for_key(redis, key)).seq
        os.kill(server.pid, signal.SIGSTOP)
        cpu1 = cpu_s(agent.pid)
        await asyncio.sleep(3.0)
        hung_cpu = (cpu_s(agent.pid) - cpu1) / 3.0
        os.kill(server.pid, signal.SIGCONT)
        hung_back_s = await fresh_key_within(url, key, seq + 1, timeout_s=5)
        # 3. Redis full (maxmemory, noeviction), then room again.
        async with reader(url) as redis:
            seq = Heartbeat.from_json(await wait_for_key(redis, key)).seq
        server.command("CONFIG", "SET", "maxmemory", "1")
        await asyncio.sleep(1.5)  # the key expires meanwhile: the worker leaves the pool
        server.command("CONFIG", "SET", "maxmemory", "0")
        full_back_s = await fresh_key_within(url, key, seq, timeout_s=4)
        # 4. Redis emptied (a restart without persistence looks the same to the agent).
        server.command("FLUSHALL")
        empty_back_s = await fresh_key_within(url, key, -1, timeout_s=2)
        rss1 = rss_mb(agent.pid)
        agent.send_signal(signal.SIGTERM)
        code, stderr = await finish(agent)
        async with reader(url) as redis:
            assert await redis.exists(key) == 0, "removed after the drain"
    finally:
        if agent.returncode is None:
            agent.kill()
            await agent.wait()
        if server is not None:
            os.kill(server.pid, signal.SIGCONT)
            server.stop()

    assert idle_cpu < 0.15, f"{idle_cpu:.0%} of a core while Redis was down"
    assert hung_cpu < 0.15, f"{hung_cpu:.0%} of a core while Redis was hung"
    # backoff is capped at max(interval, min(ttl, 5 s)) = 1 s, jittered +-20%
    assert first_s < 1.2 + 1.0, first_s
    assert hung_back_s < 1.2 + 2.2 + 0.5, hung_back_s  # + one write still timing out
    assert full_back_s < 1.2 + 1.0, full_back_s
    assert empty_back_s < 0.2 * 1.2 + 0.5, empty_back_s
    assert rss1 - rss0 < 10, f"RSS grew {rss1 - rss0:.1f} MB across the outages"
    assert code == 0
    assert stderr.count("redis unreachable") == 3, stderr  # down, hung, full
    assert stderr.count("reachable again") == 3, stderr
    assert "maxmemory" in stderr, "the log says Redis is full, not just unreachable"
    assert_clean_exit(stderr)


class OutagePublisher(HeartbeatPublisher):
    """The real publisher, refusing every write while `down` (as a hung or lost Redis)."""

    down = False

    async def publish(self, heartbeat: Heartbeat) -> None:
        if self.down:
            raise RedisUnavailableError("cannot publish heartbeat: TimeoutError")
        await super().publish(heartbeat)

    async def remove(self, worker_id: str) -> None:
        if self.down:
            raise RedisUnavailableError("cannot remove heartbeat: TimeoutError")
        await super().remove(worker_id)


@asynccontextmanager
async def ready_agent(engine: Hostile, redis_url: str, key_prefix: str,
                      drain_timeout_s: float
                      ) -> AsyncIterator[tuple[WorkerAgent, asyncio.Task[int],
                                               OutagePublisher, Any]]:
    """An agent of `engine` publishing through an OutagePublisher, running and seen
    `ready` on the routers' channel: (agent, its run, the publisher, the channel)."""
    keys = HeartbeatKeys(key_prefix)
    publisher = OutagePublisher(connect(redis_url), keys)
    try:
        async with subscribed(redis_url, keys) as channel, \
                open_engine_session(0.3) as session:
            loop = HeartbeatLoop(WorkerIdentity(WORKER, "us-east", engine.url, 16),
                                 EngineProber(session, engine.url), publisher, TIMING,
                                 rng=random.Random(5))
            agent = WorkerAgent(loop, publisher, WORKER, drain_timeout_s=drain_timeout_s)
            run = asyncio.create_task(agent.run())
            await channel.until(is_state(LifecycleState.READY))
            yield agent, run, publisher, channel
    finally:
        await publisher.aclose()


async def test_a_drain_is_not_over_until_routers_could_have_heard_of_it(
    engine: Hostile, redis_url: str, key_prefix: str
) -> None:
    async with ready_agent(engine, redis_url, key_prefix, 4.0) as (agent, run, publisher,
                                                                   channel):
        publisher.down = True  # SIGTERM arrives while Redis is away
        agent.request_drain("SIGTERM")
        await asyncio.sleep(1.0)
        still_draining = not run.done()
        publisher.down = False
        draining: Heartbeat | str | None = None
        # nothing at all (a timeout): the agent had already given up and left
        with contextlib.suppress(TimeoutError):
            draining = await channel.until(
                lambda item: isinstance(item, str) or item.state is LifecycleState.DRAINING,
                timeout_s=2)
        async with asyncio.timeout(6):
            await run
    assert still_draining, "the drain ended while no `draining` heartbeat had gone out"
    assert isinstance(draining, Heartbeat), "routers heard `gone` without `draining` first"


async def test_a_drain_with_redis_and_the_engine_both_gone_ends_at_once(
    engine: Hostile, redis_url: str, key_prefix: str
) -> None:
    """`globalpool up` killed takes Redis and the engines with it: the agent's drain has
    nothing left to finish and no router to tell, so it ends after two unreachable
    probes, not at its deadline (it used to wait the whole of it: the agents outlived a
    killed `up` by 30 s, tests/integration/test_up.py)."""
    async with ready_agent(engine, redis_url, key_prefix, 10.0) as (agent, run, publisher,
                                                                    _channel):
        publisher.down = True
        engine.hang = {"/health", "/metrics"}
        started = time.monotonic()
        agent.request_drain("SIGTERM")
        async with asyncio.timeout(15):
            await run
        took_s = time.monotonic() - started
    assert took_s < 3.0, f"the drain took {took_s:.1f} s (its deadline: 10 s)"


# --- a hostile host: the agent stopped, clocks, copy-paste ---------------------------------


def router_config(redis_url: str, key_prefix: str, tmp_path: Path) -> Path:
    path = tmp_path / "regions.yaml"
    path.write_text(yaml.safe_dump({
        "apiVersion": "globalpool/v1",
        "redis": {"url": redis_url, "key_prefix": key_prefix},
        "router": {"region": "us-east"},
        "heartbeat": {"insecure": True},
        "regions": {"us-east": {"models": ["tiny-llama"]}},
    }))
    return path


@asynccontextmanager
async def router(redis_url: str, key_prefix: str, tmp_path: Path
                 ) -> AsyncIterator[Callable[[], LifecycleState | None]]:
    """A real router app (its collector following Redis); yields `state()`: the state of
    worker 'w1' (or WORKER) in its snapshot, None when it is not there."""
    path = router_config(redis_url, key_prefix, tmp_path)
    app = build_app(RouterSettings(config=load_config(path), redis_url=redis_url,
                                   region="us-east", seed=1, config_path=path))
    runner = web.AppRunner(app)
    await runner.setup()

    def state() -> LifecycleState | None:
        workers = app[HOLDER].current.workers
        view = workers.get(WORKER) or workers.get("w1")
        return None if view is None else view.heartbeat.state

    try:
        yield state
    finally:
        await runner.cleanup()


async def until(predicate: Callable[[], Any], timeout_s: float) -> float:
    started = time.monotonic()
    async with asyncio.timeout(timeout_s):
        while not predicate():  # noqa: ASYNC110 - the snapshot has no event to wait on
            await asyncio.sleep(0.02)
    return time.monotonic() - started


async def test_a_stopped_agent_leaves_the_routers_pool_and_rejoins_after_sigcont(
    engine: Hostile, redis_url: str, key_prefix: str, tmp_path: Path
) -> None:
    async with router(redis_url, key_prefix, tmp_path) as state:
        agent, _ = await start_worker(
            "--region", "us-east", "--engine-url", engine.url, "--worker-id", "w1",
            "--redis-url", redis_url, "--key-prefix", key_prefix, "--interval-s", "0.1",
            "--ttl-s", "0.5")
        try:
            await until(lambda: state() is LifecycleState.READY, 8)
            os.kill(agent.pid, signal.SIGSTOP)
            gone_s = await until(lambda: state() is None, 4)
            await asyncio.sleep(5.0 - gone_s)
            assert state() is None, "a stale heartbeat came back while the agent was stopped"
            os.kill(agent.pid, signal.SIGCONT)
            back_s = await until(lambda: state() is LifecycleState.READY, 4)
            # and the router stops sending to an engine the agent cannot see
            engine.hang = {"/metrics"}
            unseen_s = await until(lambda: state() is not LifecycleState.READY, 4)
            agent.send_signal(signal.SIGTERM)
            code, stderr = await finish(agent)
        finally:
            if agent.returncode is None:
                os.kill(agent.pid, signal.SIGCONT)
                agent.kill()
                await agent.wait()
    assert gone_s < 0.5 + 1.0, gone_s  # its TTL, plus the router's reading
    assert back_s < 1.0, back_s
    assert unseen_s < 2 * 0.4 + 0.5 + 0.5, unseen_s  # two hung probes, a beat, a read
    assert code == 0
    assert_clean_exit(stderr)


async def test_a_wall_clock_step_back_does_not_hide_a_state_change_from_routers(
    engine: Hostile, redis_url: str, key_prefix: str, tmp_path: Path
) -> None:
    offset = [0.0]
    keys = HeartbeatKeys(key_prefix)
    timing = HeartbeatTiming(interval_s=0.1, ttl_s=3.0, max_backoff_s=0.4)
    publisher = HeartbeatPublisher(connect(redis_url), keys)
    try:
        async with router(redis_url, key_prefix, tmp_path) as state, \
                open_engine_session(0.3) as session:
            loop = HeartbeatLoop(WorkerIdentity(WORKER, "us-east", engine.url, 16),
                                 EngineProber(session, engine.url), publisher, timing,
                                 rng=random.Random(2),
                                 wall_clock=lambda: time.time() - offset[0])
            task = asyncio.create_task(loop.run())
            try:
                await until(lambda: state() is LifecycleState.READY, 8)
                offset[0] = 3600.0  # the clock steps back an hour
                await asyncio.sleep(0.3)
                engine.healthy = False
                seen: LifecycleState | str | None = "timeout"
                try:
                    await until(lambda: state() is not LifecycleState.READY, 1.0)
                    seen = state()
                except TimeoutError:
                    pass
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
    finally:
        await publisher.aclose()
    assert seen is LifecycleState.DEGRADED, f"router still had it ready ({seen})"


async def test_two_agents_with_one_worker_id_are_detected_and_logged(
    engine: Hostile, redis_url: str, key_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    twin = Hostile()
    await twin.start()
    keys = HeartbeatKeys(key_prefix)
    endpoints: list[str] = []
    try:
        async with subscribed(redis_url, keys) as channel, \
                heartbeat_loop(engine.url, redis_url, keys, timing=TIMING) as (one, _), \
                heartbeat_loop(twin.url, redis_url, keys, timing=TIMING) as (other, _):
            tasks = [asyncio.create_task(one.run()), asyncio.create_task(other.run())]
            for _ in range(12):
                item = await channel.next()
                if isinstance(item, Heartbeat):
                    endpoints.append(item.endpoint)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        await twin.stop()
    assert set(endpoints) == {engine.url, twin.url}, "both wrote as the one worker"
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
              and "us-east-test-1" in r.getMessage()]
    assert warned, f"no warning while worker us-east-test-1 flipped: {endpoints}"
    assert len(warned) <= 2, warned  # each agent once a minute, not at every beat


async def test_one_agent_alone_is_not_taken_for_two(
    engine: Hostile, redis_url: str, key_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    keys = HeartbeatKeys(key_prefix)
    async with subscribed(redis_url, keys) as channel, \
            heartbeat_loop(engine.url, redis_url, keys, timing=TIMING) as (one, _):
        task = asyncio.create_task(one.run())
        for _ in range(8):
            await channel.next()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert not [r for r in caplog.records if "same worker id" in r.getMessage()]


# --- --launch: the simulator as a launched engine that misbehaves -------------------------


SIM_ENGINE = """
import asyncio, os, signal, sys
from lab.sim.config import SimConfig
from lab.sim.server import SimServer
port, crash_after, ignore_term = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3] == "1"
async def main():
    server = SimServer(SimConfig(served_model_names=("tiny-llama",), max_num_seqs=4,
                                 decode_step_ms=1.0), port=port)
    await server.start()
    if ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if crash_after > 0:
        asyncio.get_running_loop().call_later(crash_after, os._exit, 3)
    await asyncio.Event().wait()
asyncio.run(main())
"""


def sim_engine(port: int, *, crash_after_s: float = 0.0, ignore_term: bool = False
               ) -> list[str]:
    return [sys.executable, "-c", SIM_ENGINE, str(port), str(crash_after_s),
            "1" if ignore_term else "0", "--port", str(port), "--max-num-seqs", "4"]


async def test_a_launched_engine_that_ignores_sigterm_is_killed_after_the_stop_timeout(
    redis_url: str, key_prefix: str
) -> None:
    keys = HeartbeatKeys(key_prefix)
    port = free_port()
    async with subscribed(redis_url, keys) as channel:
        agent, _ = await start_agent(
            "--region", "us-east", "--redis-url", redis_url, "--key-prefix", key_prefix,
            "--interval-s", "0.1", "--ttl-s", "0.5", "--stop-timeout-s", "1",
            "--launch", "--", *sim_engine(port, ignore_term=True))
        try:
            await channel.until(is_state(LifecycleState.READY), timeout_s=20)
            pid = await engine_pid(agent)
            started = time.monotonic()
            agent.send_signal(signal.SIGTERM)
            gone = await channel.until(lambda item: isinstance(item, str), timeout_s=5)
            code, stderr = await finish(agent)
            took = time.monotonic() - started
        finally:
            if agent.returncode is None:
                agent.kill()
                await agent.wait()
    assert gone == f"gone:us-east-127.0.0.1-{port}"
    assert code == 0
    assert not alive(pid)
    assert f"engine (pid {pid}) still running 1 s after SIGTERM; SIGKILL" in stderr
    assert took < 1.0 + 3.0, took
    assert_clean_exit(stderr)


async def test_a_launched_engine_crashing_in_a_loop_is_degraded_each_time_and_restarted(
    redis_url: str, key_prefix: str
) -> None:
    keys = HeartbeatKeys(key_prefix)
    port = free_port()
    states: list[LifecycleState] = []
    async with subscribed(redis_url, keys) as channel:
        agent, _ = await start_agent(
            "--region", "us-east", "--redis-url", redis_url, "--key-prefix", key_prefix,
            "--interval-s", "0.1", "--ttl-s", "0.5", "--max-restart-backoff-s", "0.3",
            "--max-failed-starts", "2",
            "--launch", "--", *sim_engine(port, crash_after_s=0.6))
        try:
            async with asyncio.timeout(25):
                while states.count(LifecycleState.DEGRADED) < 3:
                    item = await channel.next(timeout_s=10)
                    assert isinstance(item, Heartbeat)
                    if not states or states[-1] is not item.state:
                        states.append(item.state)
            assert agent.returncode is None, "a crash loop of healthy launches is not given up"
            agent.send_signal(signal.SIGTERM)
            code, stderr = await finish(agent)
        finally:
            if agent.returncode is None:
                agent.kill()
                await agent.wait()
    # each crash is seen as `degraded`, and `ready` again only after a healthy relaunch
    assert states[:2] == [LifecycleState.STARTING, LifecycleState.READY], states
    assert states[2:] == [LifecycleState.DEGRADED, LifecycleState.READY] * 2 + [
        LifecycleState.DEGRADED], states
    assert stderr.count("exited with code 3 after") >= 3, stderr
    assert code == 0
    assert_clean_exit(stderr)
