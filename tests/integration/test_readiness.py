"""Readiness apart from liveness, and background work that cannot die unnoticed.

A real router app on loopback, a real simulator and Valkey; heartbeats are published with
the real publisher, as in test_proxy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from lab.devstack.valkey import EmbeddedValkey, free_port
from router.app import COLLECTOR, RouterSettings, build_app, router_site
from router.config_loader import parse_config
from tests.integration.conftest import StartSim
from tests.integration.operators_fleet import scrape, value
from worker.heartbeat_keys import HeartbeatKeys
from worker.publisher import HeartbeatPublisher
from worker.redis_client import connect
from worker.schema import Capacity, Heartbeat, LifecycleState, Load

pytestmark = pytest.mark.integration


class Router:
    def __init__(self, url: str, app: web.Application) -> None:
        self.url = url
        self.app = app

    async def get(self, path: str) -> tuple[int, dict[str, Any]]:
        async with aiohttp.ClientSession() as session, session.get(
                f"{self.url}{path}") as response:
            return response.status, await response.json()


StartRouter = Callable[..., Awaitable[Router]]


@pytest.fixture
async def start_router(key_prefix: str, start_sim: StartSim) -> AsyncIterator[StartRouter]:
    runners: list[web.AppRunner] = []
    publishers: list[HeartbeatPublisher] = []

    async def start(redis_url: str, *, workers: int = 1, insecure: bool = True,
                    **router: Any) -> Router:
        for index in range(workers):
            sim = await start_sim(served_model_names=("m",), seed=index)
            publisher = HeartbeatPublisher(connect(redis_url), HeartbeatKeys(key_prefix))
            publishers.append(publisher)
            await publisher.publish(Heartbeat(
                worker_id=f"w{index}", region="us-east", endpoint=sim.url, models=("m",),
                state=LifecycleState.READY, capacity=Capacity(max_num_seqs=8),
                load=Load(running=0, waiting=0, kv_cache_usage=0.0), seq=1,
                sent_at_s=time.time(), ttl_s=60.0))
        config = parse_config({
            "apiVersion": "globalpool/v1",
            "redis": {"url": redis_url, "key_prefix": key_prefix},
            "router": {"region": "us-east", **router},
            "heartbeat": {"insecure": insecure},  # the test publishes unsigned heartbeats
            "regions": {"us-east": {"models": ["m"]}},
        })
        app = build_app(RouterSettings(config=config, redis_url=redis_url, region="us-east"))
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        port = free_port()
        await router_site(runner, "127.0.0.1", port).start()
        runners.append(runner)
        return Router(f"http://127.0.0.1:{port}", app)

    yield start
    for runner in runners:
        await runner.cleanup()
    for publisher in publishers:
        await publisher.aclose()


async def _until(check: Callable[[], Awaitable[bool]], limit_s: float, what: str) -> float:
    started = time.monotonic()
    while not await check():
        assert time.monotonic() - started < limit_s, what
        await asyncio.sleep(0.02)
    return time.monotonic() - started


async def test_a_router_that_cannot_reach_redis_is_alive_but_not_ready(
        start_router: StartRouter, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "globalpool.registry")
    router = await start_router(f"redis://127.0.0.1:{free_port()}", workers=0)
    status, health = await router.get("/health")
    assert status == 200 and health["redis_connected"] is False
    status, ready = await router.get("/ready")
    assert status == 503, ready
    assert ready["reason"].startswith("no view of the fleet yet"), ready
    assert "redis unreachable" in caplog.text and "every request gets 503" in caplog.text


async def test_a_collector_crash_is_counted_and_restarted_and_not_ready_meanwhile(
        redis_url: str, start_router: StartRouter, caplog: pytest.LogCaptureFixture) -> None:
    router = await start_router(redis_url)
    await _until(lambda: _ready(router), 5, "never ready")
    # Three crashes in a row (the loop's turn, then its next two starts): ~0.7 s down.
    router.app[COLLECTOR].inject_fault(RuntimeError("injected collector fault"), times=3)
    crashed_at = time.monotonic()
    await _until(lambda: _not_ready(router), 2, "readiness never noticed the crash")
    status, ready = await router.get("/ready")
    if status == 503:  # (it may be back already on a fast machine)
        assert "collector is not running" in ready["reason"], ready
    await _until(lambda: _ready(router), 5, "the collector never came back")
    back_after_s = time.monotonic() - crashed_at
    print(f"collector crashed 3 times in a row; ready again {back_after_s:.2f} s after the "
          "first crash")
    assert back_after_s < 2.0, back_after_s
    samples = await scrape(router.url)
    assert value(samples, "globalpool_background_task_crashes_total",
                 task="heartbeat-collector") == 3
    assert value(samples, "globalpool_background_task_up", task="heartbeat-collector") == 1
    assert "injected collector fault" in caplog.text  # the traceback is in the log
    assert "Traceback" in caplog.text


async def test_fail_static_keeps_a_router_ready_for_fail_static_s(
        start_router: StartRouter) -> None:
    server = EmbeddedValkey.start()
    try:
        router = await start_router(server.url, fail_static_s=1.5)
        await _until(lambda: _ready(router), 5, "never ready")
        server.stop()
        await asyncio.sleep(0.8)
        status, ready = await router.get("/ready")
        assert status == 200 and ready["fail_static"] is True, ready  # the view is trusted
        await _until(lambda: _not_ready(router), 5, "an old view was trusted forever")
        status, ready = await router.get("/ready")
        assert "past router.fail_static_s" in ready["reason"], ready
    finally:
        server.stop()


async def _ready(router: Router) -> bool:
    return (await router.get("/ready"))[0] == 200


async def _not_ready(router: Router) -> bool:
    return (await router.get("/ready"))[0] == 503


async def test_a_router_without_keys_refuses_unsigned_heartbeats_unless_told_otherwise(
        redis_url: str, start_router: StartRouter, caplog: pytest.LogCaptureFixture) -> None:
    router = await start_router(redis_url, insecure=False)  # no keys, no opt-out
    assert "no heartbeat signing keys" in caplog.text
    await asyncio.sleep(0.5)
    status, ready = await router.get("/ready")
    assert status == 503 and ready["reason"] == "no worker is ready for any model", ready
    samples = await scrape(router.url)
    assert value(samples, "globalpool_heartbeats_dropped_total", reason="no_keys") >= 1
    caplog.clear()
    opted_out = await start_router(redis_url, insecure=True)  # heartbeat.insecure: true
    await _until(lambda: _ready(opted_out), 5, "the opt-out believes unsigned heartbeats")
    assert "heartbeat.insecure: true" in caplog.text  # warned at start
