"""Wiring only: routes, typed app keys, and the background tasks' lifecycle."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal
import socket
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from opentelemetry.trace import TracerProvider

from router.admin.setup import Operations
from router.admission.gate import Admission
from router.admission.queue import RouterQueue
from router.admission.setup import build_admission, heartbeat_gate
from router.batch import service as batch_service
from router.batch.service import BatchService
from router.compiled import compiled_modules
from router.config import GlobalConfig
from router.core.errors import openai_errors
from router.core.stats import SecurityStats
from router.event_loop import new_event_loop, tune_gc
from router.health import BreakerPolicy, Health, RetryBudget
from router.policy import RoutingContext, create_policy
from router.policy.batch_room import BatchRoom
from router.processes import ProcessSlot
from router.proxy import catalog
from router.proxy.aiohttp_server import add_inference_routes
from router.proxy.exchange import AiohttpExchange, InferenceHandler
from router.proxy.handlers import Proxy
from router.proxy.request_id import answer_with_request_id
from router.proxy.responses import RESPONSES_PATH, ResponsesApi
from router.proxy.shares import ConnectionShares
from router.proxy.site import FrontSite
from router.proxy.upstream.pool import UpstreamPool
from router.readiness import CollectorState, readiness
from router.registry import HeartbeatCollector, SnapshotHolder
from router.registry.inflight import InFlight
from router.registry.mirror import MirroredCollector, keep_fleet_view
from router.registry.peers import PeerExchange
from router.registry.response_store import ResponseStore
from router.supervisor import Supervised
from worker import redis_client
from worker.heartbeat_keys import HeartbeatKeys
from worker.signing import KEY_ID_ENV, keys_from_environ

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
    # One of several processes of this replica on one socket (router.processes); None:
    # the only one, listening itself.
    process: ProcessSlot | None = None


SETTINGS = web.AppKey("settings", RouterSettings)
# Hot reload, drain flags, admin API, status page, metrics, traces (router.admin.setup).
OPERATIONS = web.AppKey("operations", Operations)
HOLDER = web.AppKey("holder", SnapshotHolder)
PROXY = web.AppKey("proxy", Proxy)
# The proxy's inference handler as both servers call it (in a span each, when tracing).
INFERENCE: web.AppKey[InferenceHandler] = web.AppKey("inference")
COLLECTOR: web.AppKey[HeartbeatCollector | MirroredCollector] = web.AppKey("collector")
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
# This router's heartbeat signing keys ({}: none; the status page says how it verifies).
HEARTBEAT_KEYS = web.AppKey("heartbeat_keys", dict)
# Which worker holds each stored response of the Responses API (shared through Redis).
RESPONSE_STORE = web.AppKey("response_store", ResponseStore)
# The Files and Batch APIs and this replica's runner of its share of every batch.
BATCHES = web.AppKey("batches", BatchService)
# The supervised background tasks, by name (router.supervisor): crashes are restarted.
BACKGROUND: web.AppKey[dict[str, Supervised]] = web.AppKey("background")


def build_app(settings: RouterSettings) -> web.Application:
    config = settings.config
    operations = Operations.create(
        config, config_path=settings.config_path, region=settings.region,
        policy_override=settings.policy, tracer_provider=settings.tracer_provider,
        process=settings.process,
    )
    app = web.Application(middlewares=[openai_errors],
                          client_max_size=config.router.max_body_bytes)
    app.on_response_prepare.append(answer_with_request_id)
    app[SETTINGS] = settings
    app[HOLDER] = SnapshotHolder()
    app[SECURITY_STATS] = SecurityStats()
    app.cleanup_ctx.append(_fleet_view)
    app.cleanup_ctx.append(_admission)
    app.cleanup_ctx.append(_proxy)
    app.cleanup_ctx.append(_batches)
    app[OPERATIONS] = operations
    app.cleanup_ctx.append(_operations)
    operations.add_routes(app)
    add_inference_routes(app, _inference, PROXY)  # (their `Expect` answered first)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/v1/models/{model_id:.+}", _model)  # ids may hold '/'
    app.router.add_get("/health", _health)
    app.router.add_get("/ready", _ready)
    # A stored response, at the worker that holds it.
    app.router.add_get(RESPONSES_PATH + "/{response_id}", _stored_response)
    app.router.add_post(RESPONSES_PATH + "/{response_id}/cancel", _stored_response)
    batch_service.add_routes(app, BATCHES)
    return app


async def _stored_response(request: web.Request) -> web.StreamResponse:
    responses = request.app[PROXY].responses
    assert responses is not None  # (built with the proxy)
    return await responses.by_id(request)


async def _inference(request: web.Request) -> web.StreamResponse:
    """Inference on a connection aiohttp serves (`router.proxy.front` serves the rest)."""
    exchange = AiohttpExchange(request)
    return exchange.answer(await request.app[INFERENCE](exchange))


async def _models(request: web.Request) -> web.Response:
    return await catalog.models(request.app[PROXY], request)


async def _model(request: web.Request) -> web.Response:
    return await catalog.model(request.app[PROXY], request, request.match_info["model_id"])


async def _health(request: web.Request) -> web.Response:
    return await catalog.health_check(request.app[PROXY], request)


async def _ready(request: web.Request) -> web.Response:
    """GET /ready: 200 when this router can route now, else 503 with the reason."""
    app = request.app
    collector = app[BACKGROUND]["heartbeat-collector"]
    ready, document = readiness(
        app[HOLDER].current,
        CollectorState(collector.running, collector.crashes, collector.last_error),
        app[OPERATIONS].configs.current.router.fail_static_s, time.monotonic())
    return web.json_response(document, status=200 if ready else 503)


async def _fleet_view(app: web.Application) -> AsyncIterator[None]:
    """Redis clients and the heartbeat collector, for the app's lifetime."""
    settings = app[SETTINGS]
    inflight = app[_INFLIGHT] = InFlight()
    health_config = settings.config.router.health
    health = app[_HEALTH] = Health(BreakerPolicy(
        failures_to_eject=health_config.failures_to_eject,
        base_backoff_s=health_config.base_backoff_s,
        max_backoff_s=health_config.max_backoff_s,
    ), stall_after_s=health_config.stall_after_s, stall_factor=health_config.stall_factor,
       views=lambda: app[HOLDER].current.workers)
    background = app[BACKGROUND] = {}
    background["stall-watch"] = Supervised("stall-watch", health.watch_stalls).start()
    background["loop-lag"] = Supervised("loop-lag", health.watch_loop_lag).start()
    redis = redis_client.connect(settings.redis_url)
    pubsub_redis = redis_client.connect_pubsub(settings.redis_url)
    keys = (keys_from_environ(os.environ) if settings.heartbeat_keys is None
            else settings.heartbeat_keys)
    app[HEARTBEAT_KEYS] = dict(keys)
    app[RESPONSE_STORE] = ResponseStore(
        redis, settings.config.redis.key_prefix,
        ttl_s=settings.config.router.responses.ttl_s, keys=keys,
        signing_key_id=os.environ.get(KEY_ID_ENV) or None)
    collector = HeartbeatCollector(
        redis=redis, pubsub_redis=pubsub_redis,
        keys=HeartbeatKeys(settings.config.redis.key_prefix,
                           sharded=redis_client.is_cluster_url(settings.redis_url)),
        regions=lambda: app[OPERATIONS].configs.current.regions.keys(),
        holder=app[HOLDER],
        local_inflight=inflight.of,
        gate=heartbeat_gate(lambda: app[OPERATIONS].configs.current,  # follows reloads
                            keys, app[SECURITY_STATS]),
        # A worker whose heartbeat turns `degraded` is ejected like a refused connection.
        on_down=lambda view: health.reported_down(view.worker_id, view.region,
                                                  view.heartbeat.condition()),
        cpu_share=lambda: app[OPERATIONS].configs.current.router.fleet_view_cpu_share,
        agent_interval_s=lambda: app[OPERATIONS].configs.current.heartbeat.interval_s,
    )
    # Alone, or the first of several processes: reads Redis (and ships to the others).
    view = app[COLLECTOR] = keep_fleet_view(collector, settings.process, background)
    app[OPERATIONS].configs.on_swap(lambda _old, _new: view.recheck())  # at once
    peers = app[PEERS] = PeerExchange(
        redis=redis, pubsub_redis=pubsub_redis,
        channel=redis_client.one_slot_prefix(settings.config.redis.key_prefix,
                                             settings.redis_url) + ":routers:inflight",
        inflight=inflight, workers=lambda: app[HOLDER].current.workers,
        interval_s=lambda: app[OPERATIONS].configs.current.router.peer_interval_ms / 1000.0,
        keys=keys, stats=app[SECURITY_STATS], region=settings.region)
    background["peer-exchange"] = Supervised("peer-exchange", peers.run).start()
    with contextlib.suppress(TimeoutError):
        # Serve sooner with an empty view rather than never if Redis is down at start
        # (/ready says 503 meanwhile, and the collector's log says why).
        async with asyncio.timeout(3.0):
            await view.synced.wait()
    yield
    await asyncio.gather(*(task.stop() for task in background.values()))
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
    """The request path, with one pool of keep-alive connections to all the workers."""
    settings = app[SETTINGS]
    config = settings.config
    upstreams = UpstreamPool(connect_timeout_s=config.router.timeouts.connect_s,
                             keepalive_s=UPSTREAM_KEEPALIVE_S)
    health_config = config.router.health
    health = app[_HEALTH]
    context = RoutingContext(
        rtt_ms=app[OPERATIONS].configs.rtt_ms,  # follows hot reloads
        inflight=app[_INFLIGHT],
        rng=random.Random(settings.seed),
        near_equal_ms=config.router.near_equal_ms,
        health=health,
        region_cost=lambda region: app[OPERATIONS].configs.current.cost_per_gpu_hour(region),
        batch_room=BatchRoom(lambda: app[OPERATIONS].configs.current.batch.fixed_reserve,
                             inflight=app[_INFLIGHT], me=app[PEERS].router),
    )
    app[PEERS].share(context.affinity)  # (the peers' sends fill it too)
    batch_room = context.batch_room  # (its lines: not interactive; its models: a share)
    app[PEERS].share_batch(batch_room.counts, lambda: batch_room.ready)
    operations = app[OPERATIONS]
    queue_config = config.router.queue
    queue = (RouterQueue(app[_INFLIGHT], max_requests=queue_config.max_requests,
                         max_wait_s=queue_config.max_wait_ms / 1000.0)
             if queue_config.enabled else None)
    responses = ResponsesApi(app[RESPONSE_STORE], app[HOLDER], upstreams, operations.configs,
                             app[ADMISSION])
    app[PROXY] = Proxy(
        responses=responses,
        configs=operations.configs,
        region=settings.region,
        holder=app[HOLDER],
        policy=create_policy(settings.policy or config.router.policy, context),
        inflight=app[_INFLIGHT],
        upstreams=upstreams,
        health=health,
        retry_budget=RetryBudget(health_config.retry_budget_ratio,
                                 min_per_s=health_config.retry_budget_min_per_s),
        admission=app[ADMISSION],
        observers=operations.observers,
        drains=operations.drains,
        propagate_trace=operations.tracer_provider is not None,
        queue=queue,
    )
    app[INFERENCE] = operations.inference(app[PROXY])
    yield
    if queue is not None:
        await queue.close()
    await upstreams.close()


async def _batches(app: web.Application) -> AsyncIterator[None]:
    """Files, batches and this replica's batch runner (supervised: a crash restarts it; a
    replica that stops leaves its leases to end, and other replicas take its lines)."""
    async with batch_service.opened(app[SETTINGS].redis_url, app[PROXY], app[ADMISSION],
                                    app[OPERATIONS].configs, app[HEARTBEAT_KEYS]) as service:
        app[BATCHES] = service
        running = app[BACKGROUND]["batch-runner"] = Supervised(
            "batch-runner", service.runner.run).start()
        yield
        await running.stop()
        del app[BACKGROUND]["batch-runner"]


async def _operations(app: web.Application) -> AsyncIterator[None]:
    """Drain flags, config hot reload and the admin context, for the app's lifetime."""
    operations = app[OPERATIONS]
    fleet_tasks: dict[str, Supervised] = app[BACKGROUND]
    await operations.start(app, redis_url=app[SETTINGS].redis_url, proxy=app[PROXY],
                           snapshots=app[HOLDER], inflight=app[_INFLIGHT],
                           security=app[SECURITY_STATS], heartbeat_counts=app[COLLECTOR].counts,
                           heartbeat_upkeep=app[COLLECTOR].upkeep,
                           background=lambda: {
                               **_task_states(fleet_tasks, operations.supervised),
                               **_queue_pump(app[PROXY].queue)},
                           heartbeat_keys=app[HEARTBEAT_KEYS],
                           batches=app[BATCHES].runner)
    yield
    await operations.stop()


def _queue_pump(queue: RouterQueue | None) -> dict[str, tuple[bool, int]]:
    """The queue's pump runs only while requests wait; a crash restarts it at once."""
    return {} if queue is None else {"queue-pump": (True, queue.pump_crashes)}


def _task_states(*groups: Mapping[str, Supervised]) -> dict[str, tuple[bool, int]]:
    """Every supervised task's (running, crashes), for /metrics."""
    return {name: (task.running, task.crashes)
            for group in groups for name, task in group.items()}


def router_site(runner: web.AppRunner, host: str, port: int, *,
                shutdown_timeout_s: float = 60.0, slot: ProcessSlot | None = None
                ) -> FrontSite:
    """The listening site for a set-up router app: inference on the router's own front
    (`router.proxy.front`), everything else on aiohttp. `slot`: one of several processes
    (router.processes), accepting on the socket they share instead of host:port."""
    app = runner.app
    header_s = app[OPERATIONS].configs.current.router.client_timeouts.header_s
    sock = None if slot is None else socket.socket(fileno=slot.listen_fd)
    shares = None if slot is None else ConnectionShares(slot.shares_file, slot.index)
    return FrontSite(runner, host, port, handler=app[INFERENCE], header_timeout_s=header_s,
                     shutdown_timeout_s=shutdown_timeout_s, sock=sock, shares=shares)


def run(settings: RouterSettings, host: str, port: int) -> None:
    """Serve until SIGINT/SIGTERM. Client disconnects cancel their handler (and upstream).
    SIGHUP reloads regions.yaml."""
    slot = settings.process
    if slot is None:
        log.info("router region=%s starting on http://%s:%d", settings.region, host, port)
    else:
        log.info("router region=%s: process %d of %d (start %d) on the supervisor's socket",
                 settings.region, slot.index, slot.count, slot.starts)
    app = build_app(settings)
    compiled = compiled_modules()
    log.info("request path: %s", f"compiled ({len(compiled)} modules, mypyc)" if compiled
             else "pure Python (GLOBALPOOL_COMPILE=1 pip install . compiles it)")
    tune_gc()
    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(_serve(app, host, port))
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        asyncio.set_event_loop(None)
        loop.close()


async def _serve(app: web.Application, host: str, port: int) -> None:
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        # Also closes a connection whose request headers have not all arrived by then.
        keepalive_timeout=app[SETTINGS].config.router.client_timeouts.header_s,
        access_log=None,
    )
    await runner.setup()
    slot = app[SETTINGS].process
    try:
        await router_site(runner, host, port, slot=slot).start()
        if slot is None:
            print(f"router listening on http://{host}:{port}", flush=True)
        else:
            print(f"router listening on http://{host}:{port} (process {slot.index} of "
                  f"{slot.count})", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        # (Under a supervisor SIGINT is its alone: router.processes.follow_supervisor.)
        for signum in (signal.SIGTERM,) if slot is not None else (signal.SIGINT,
                                                                   signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        loop.add_signal_handler(signal.SIGHUP, app[OPERATIONS].reload_on_signal)
        await stop.wait()
    finally:
        await runner.cleanup()
