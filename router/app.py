"""Wiring only: routes, typed app keys, and the background tasks' lifecycle."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from router.config import GlobalConfig
from router.policy import RoutingContext, create_policy
from router.policy.inflight import InFlight
from router.proxy.errors import openai_errors
from router.proxy.handlers import Proxy
from router.registry import HeartbeatCollector, SnapshotHolder
from worker import redis_client
from worker.schema import HeartbeatKeys

log = logging.getLogger("globalpool.router")


@dataclass(frozen=True)
class RouterSettings:
    """What one router replica runs with, beyond regions.yaml."""

    config: GlobalConfig
    redis_url: str
    region: str | None
    policy: str | None = None
    seed: int | None = None


SETTINGS = web.AppKey("settings", RouterSettings)
HOLDER = web.AppKey("holder", SnapshotHolder)
PROXY = web.AppKey("proxy", Proxy)
COLLECTOR = web.AppKey("collector", HeartbeatCollector)
_INFLIGHT = web.AppKey("inflight", InFlight)


def build_app(settings: RouterSettings) -> web.Application:
    config = settings.config
    app = web.Application(
        middlewares=[openai_errors], client_max_size=config.router.max_body_bytes
    )
    app[SETTINGS] = settings
    app[HOLDER] = SnapshotHolder()
    app.cleanup_ctx.append(_fleet_view)
    app.cleanup_ctx.append(_proxy)
    app.router.add_post("/v1/chat/completions", _inference)
    app.router.add_post("/v1/completions", _inference)
    app.router.add_post("/v1/embeddings", _inference)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    return app


async def _inference(request: web.Request) -> web.StreamResponse:
    return await request.app[PROXY].inference(request)


async def _models(request: web.Request) -> web.Response:
    return await request.app[PROXY].models(request)


async def _health(request: web.Request) -> web.Response:
    return await request.app[PROXY].health(request)


async def _fleet_view(app: web.Application) -> AsyncIterator[None]:
    """Redis clients and the heartbeat collector, for the app's lifetime."""
    settings = app[SETTINGS]
    inflight = InFlight()
    app[_INFLIGHT] = inflight
    redis = redis_client.connect(settings.redis_url)
    pubsub_redis = redis_client.connect_pubsub(settings.redis_url)
    collector = HeartbeatCollector(
        redis=redis,
        pubsub_redis=pubsub_redis,
        keys=HeartbeatKeys(settings.config.redis.key_prefix),
        holder=app[HOLDER],
        local_inflight=inflight.of,
    )
    app[COLLECTOR] = collector
    task = asyncio.create_task(collector.run(), name="heartbeat-collector")
    with contextlib.suppress(TimeoutError):
        # Serve sooner with an empty view rather than never if Redis is down at start.
        await asyncio.wait_for(collector.synced.wait(), timeout=3.0)
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await redis.aclose()
    await pubsub_redis.aclose()


async def _proxy(app: web.Application) -> AsyncIterator[None]:
    """One client session for all upstream workers: pooled keep-alive connections."""
    settings = app[SETTINGS]
    config = settings.config
    timeouts = config.router.timeouts
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30)
    session = aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(
            total=None, connect=timeouts.connect_s, sock_connect=timeouts.connect_s
        ),
        auto_decompress=False,
        skip_auto_headers=("Accept-Encoding", "User-Agent"),
    )
    context = RoutingContext(
        rtt_ms=config.rtt_ms,
        inflight=app[_INFLIGHT],
        rng=random.Random(settings.seed),
        near_equal_ms=config.router.near_equal_ms,
    )
    app[PROXY] = Proxy(
        config=config,
        region=settings.region,
        holder=app[HOLDER],
        policy=create_policy(settings.policy or config.router.policy, context),
        inflight=app[_INFLIGHT],
        session=session,
    )
    yield
    await session.close()


def run(settings: RouterSettings, host: str, port: int) -> None:
    """Serve until SIGINT/SIGTERM. Client disconnects cancel their handler (and upstream)."""
    log.info("router region=%s listening on http://%s:%d", settings.region, host, port)
    web.run_app(
        build_app(settings),
        host=host,
        port=port,
        handler_cancellation=True,
        access_log=None,
        print=lambda _msg: print(f"router listening on http://{host}:{port}", flush=True),
        loop=new_event_loop(),
    )


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when available: it roughly halves the per-request cost of the proxy."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop
