"""Wiring only: routes, typed app keys, and the background tasks' lifecycle."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import random
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp import web
from opentelemetry.trace import TracerProvider

from router.admin.setup import Operations
from router.admission.gate import Admission, add_rate_limit_headers
from router.admission.queue import RouterQueue
from router.admission.setup import build_admission, heartbeat_gate
from router.admission.stats import SecurityStats
from router.config import GlobalConfig
from router.health import BreakerPolicy, Health, RetryBudget
from router.policy import RoutingContext, create_policy
from router.policy.inflight import InFlight
from router.proxy.errors import openai_errors
from router.proxy.handlers import Proxy
from router.registry import HeartbeatCollector, SnapshotHolder
from router.registry.peers import PeerExchange
from worker import redis_client
from worker.schema import HeartbeatKeys
from worker.signing import keys_from_environ

log = logging.getLogger("globalpool.router")


@dataclass(frozen=True)
class RouterSettings:
    """What one router replica runs with, beyond regions.yaml."""

    config: GlobalConfig
    redis_url: str
    region: str | None
    policy: str | None = None
    seed: int | None = None
    # Heartbeat signing keys {key_id: secret}; None: from the environment (worker.signing).
    heartbeat_keys: Mapping[str, bytes] | None = None
    # The regions.yaml `config` came from: watched for hot reload (None: no reload).
    config_path: Path | None = None
    # Traces go here; None: OTLP export when the OTEL_* variables say so, else none.
    tracer_provider: TracerProvider | None = None


SETTINGS = web.AppKey("settings", RouterSettings)
# Hot reload, drain flags, admin API, status page, metrics, traces (router.admin.setup).
OPERATIONS = web.AppKey("operations", Operations)
HOLDER = web.AppKey("holder", SnapshotHolder)
PROXY = web.AppKey("proxy", Proxy)
COLLECTOR = web.AppKey("collector", HeartbeatCollector)
PEERS = web.AppKey("peers", PeerExchange)
_INFLIGHT = web.AppKey("inflight", InFlight)
_HEALTH = web.AppKey("health", Health)
# Idle upstream connections are reused for at most this long: below the 5 s after which
# vLLM's server (uvicorn's default keep-alive) closes them. A pooled connection that the
# worker has closed breaks the next request sent on it (a reset before the first byte).
UPSTREAM_KEEPALIVE_S = 4.0
ADMISSION = web.AppKey("admission", Admission)
# Auth, rate-limit, residency and heartbeat-verification counters (for /metrics).
SECURITY_STATS = web.AppKey("security_stats", SecurityStats)


def build_app(settings: RouterSettings) -> web.Application:
    config = settings.config
    operations = Operations.create(
        config, config_path=settings.config_path, region=settings.region,
        policy_override=settings.policy, tracer_provider=settings.tracer_provider,
    )
    app = web.Application(
        middlewares=[*operations.middlewares, openai_errors],
        client_max_size=config.router.max_body_bytes,
    )
    app[SETTINGS] = settings
    app[HOLDER] = SnapshotHolder()
    app[SECURITY_STATS] = SecurityStats()
    app.on_response_prepare.append(add_rate_limit_headers)
    app.cleanup_ctx.append(_fleet_view)
    app.cleanup_ctx.append(_admission)
    app.cleanup_ctx.append(_proxy)
    app[OPERATIONS] = operations
    app.cleanup_ctx.append(_operations)
    operations.add_routes(app)
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
    return await request.app[PROXY].health_check(request)


async def _fleet_view(app: web.Application) -> AsyncIterator[None]:
    """Redis clients and the heartbeat collector, for the app's lifetime."""
    settings = app[SETTINGS]
    inflight = InFlight()
    app[_INFLIGHT] = inflight
    health_config = settings.config.router.health
    health = app[_HEALTH] = Health(BreakerPolicy(
        failures_to_eject=health_config.failures_to_eject,
        base_backoff_s=health_config.base_backoff_s,
        max_backoff_s=health_config.max_backoff_s,
    ), stall_after_s=health_config.stall_after_s, stall_factor=health_config.stall_factor,
       views=lambda: app[HOLDER].current.workers)
    stalls = asyncio.create_task(health.watch_stalls(), name="stall-watch")
    redis = redis_client.connect(settings.redis_url)
    pubsub_redis = redis_client.connect_pubsub(settings.redis_url)
    keys = (keys_from_environ(os.environ) if settings.heartbeat_keys is None
            else settings.heartbeat_keys)
    collector = HeartbeatCollector(
        redis=redis,
        pubsub_redis=pubsub_redis,
        keys=HeartbeatKeys(settings.config.redis.key_prefix),
        holder=app[HOLDER],
        local_inflight=inflight.of,
        gate=heartbeat_gate(lambda: app[OPERATIONS].configs.current,  # follows reloads
                            keys, app[SECURITY_STATS]),
        # A worker whose heartbeat turns `degraded` is ejected like a refused connection.
        on_down=lambda view: health.reported_down(view.worker_id, view.region,
                                                  view.heartbeat.state.value),
    )
    app[COLLECTOR] = collector
    task = asyncio.create_task(collector.run(), name="heartbeat-collector")
    peers = app[PEERS] = PeerExchange(
        redis=redis, pubsub_redis=pubsub_redis,
        channel=f"{settings.config.redis.key_prefix}:routers:inflight", inflight=inflight,
        interval_s=lambda: app[OPERATIONS].configs.current.router.peer_interval_ms / 1000.0,
        keys=keys, stats=app[SECURITY_STATS])
    peer_task = asyncio.create_task(peers.run(), name="peer-exchange")
    with contextlib.suppress(TimeoutError):
        # Serve sooner with an empty view rather than never if Redis is down at start.
        await asyncio.wait_for(collector.synced.wait(), timeout=3.0)
    yield
    for running in (task, stalls, peer_task):
        running.cancel()
    await asyncio.gather(task, stalls, peer_task, return_exceptions=True)
    await redis.aclose()
    await pubsub_redis.aclose()


async def _admission(app: web.Application) -> AsyncIterator[None]:
    """API keys and rate limits (with their own Redis pool), for the app's lifetime."""
    settings = app[SETTINGS]
    app[ADMISSION] = build_admission(settings.config, settings.redis_url, app[SECURITY_STATS])
    if settings.config.auth.enabled:
        await app[ADMISSION].warm_up()  # at most 1 s, only when limits can apply
    yield
    await app[ADMISSION].aclose()


async def _proxy(app: web.Application) -> AsyncIterator[None]:
    """One client session for all upstream workers: pooled keep-alive connections."""
    settings = app[SETTINGS]
    config = settings.config
    timeouts = config.router.timeouts
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0,
                                     keepalive_timeout=UPSTREAM_KEEPALIVE_S)
    session = aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(
            total=None, connect=timeouts.connect_s, sock_connect=timeouts.connect_s
        ),
        auto_decompress=False,
        skip_auto_headers=("Accept-Encoding", "User-Agent"),
    )
    health_config = config.router.health
    health = app[_HEALTH]
    context = RoutingContext(
        rtt_ms=app[OPERATIONS].configs.rtt_ms,  # follows hot reloads
        inflight=app[_INFLIGHT],
        rng=random.Random(settings.seed),
        near_equal_ms=config.router.near_equal_ms,
        health=health,
        region_cost=lambda region: app[OPERATIONS].configs.current.cost_per_gpu_hour(region),
    )
    operations = app[OPERATIONS]
    queue_config = config.router.queue
    queue = (RouterQueue(app[_INFLIGHT], max_requests=queue_config.max_requests,
                         max_wait_s=queue_config.max_wait_ms / 1000.0)
             if queue_config.enabled else None)
    app[PROXY] = Proxy(
        configs=operations.configs,
        region=settings.region,
        holder=app[HOLDER],
        policy=create_policy(settings.policy or config.router.policy, context),
        inflight=app[_INFLIGHT],
        session=session,
        health=health,
        retry_budget=RetryBudget(health_config.retry_budget_ratio,
                                 min_per_s=health_config.retry_budget_min_per_s),
        admission=app[ADMISSION],
        observers=operations.observers,
        drains=operations.drains,
        propagate_trace=operations.tracer_provider is not None,
        queue=queue,
    )
    yield
    if queue is not None:
        await queue.close()
    await session.close()


async def _operations(app: web.Application) -> AsyncIterator[None]:
    """Drain flags, config hot reload and the admin context, for the app's lifetime."""
    operations = app[OPERATIONS]
    await operations.start(app, redis_url=app[SETTINGS].redis_url, proxy=app[PROXY],
                           snapshots=app[HOLDER], inflight=app[_INFLIGHT],
                           security=app[SECURITY_STATS])
    yield
    await operations.stop()


# Python's cyclic garbage collector, set for this process: a router holds a large
# long-lived fleet view (~20 objects per worker) and allocates a lot per request and per
# heartbeat. With the default thresholds (700, 10, 10) it collects the young generation
# every few heartbeats and rescans the whole fleet view often: at 10,000 workers and 4 Hz
# that was ~40% of the collector's CPU (`globalpool bench-heartbeats`, BENCHMARKS.md).
GC_THRESHOLDS = (50_000, 20, 100)


def tune_gc() -> None:
    """Freeze what start-up allocated (modules, config) out of every future collection and
    collect the young generations less often (see GC_THRESHOLDS)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def run(settings: RouterSettings, host: str, port: int) -> None:
    """Serve until SIGINT/SIGTERM. Client disconnects cancel their handler (and upstream)."""
    log.info("router region=%s listening on http://%s:%d", settings.region, host, port)
    app = build_app(settings)
    tune_gc()
    web.run_app(
        app,
        host=host,
        port=port,
        handler_cancellation=True,
        # Also closes a connection whose request headers have not all arrived by then.
        keepalive_timeout=settings.config.router.client_timeouts.header_s,
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
