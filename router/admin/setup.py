"""Wiring of the operators' surface into one router app: reload, drains, admin, telemetry.

`router.app` creates one `Operations` per app (no globals: its own metrics registry, its
own tracer provider), takes its observers and holders when it builds the proxy, and its
inference handler (traced or not), and runs `start()`/`stop()` in its cleanup context.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import TracerProvider as ApiTracerProvider
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from redis.asyncio import Redis

from router.admin.auth import AdminAuth
from router.admin.events import EventLog
from router.admin.routes import ADMIN, add_admin_routes
from router.admin.status import AdminContext
from router.batch.metrics import BatchCollector
from router.batch.runner import BatchRunner
from router.config import GlobalConfig
from router.config_checks import runtime_problems
from router.config_reload import ConfigHolder, ConfigWatcher, ReloadError, initial_holder
from router.core.outcome import Observer
from router.core.stats import SecurityStats
from router.policy import create_policy
from router.processes import ProcessSlot
from router.proxy.exchange import InferenceHandler
from router.proxy.handlers import Proxy
from router.registry.drains import DrainHolder, DrainKeys, DrainRecord, DrainStore
from router.registry.inflight import InFlight
from router.registry.snapshot import SnapshotHolder
from router.supervisor import Supervised
from router.telemetry.fleet import FleetCollector
from router.telemetry.machine import Kept, merge, read_siblings, serve_own
from router.telemetry.metrics import RequestMetrics, metrics_handler
from router.telemetry.responses import ResponsesCollector
from router.telemetry.security import SecurityCollector
from router.telemetry.tracing import SpanAnnotator, traced, tracer_provider_from_env
from router.telemetry.window import TrafficWindow
from worker import redis_client

log = logging.getLogger("globalpool.admin")

EVENT_PROBLEMS = 10  # a config_refused event's detail: its first problems


@dataclass
class Operations:
    """Hot reload, drain flags, admin API, status page, metrics and traces of one app."""

    configs: ConfigHolder
    region: str | None
    policy_override: str | None = None
    tracer_provider: ApiTracerProvider | None = None
    owns_tracer_provider: bool = False
    drains: DrainHolder = field(default_factory=DrainHolder)
    events: EventLog = field(default_factory=EventLog)
    window: TrafficWindow = field(default_factory=TrafficWindow)
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    metrics: RequestMetrics = field(init=False)
    # Background tasks (drain flags, config watcher), supervised: restarted on a crash.
    supervised: dict[str, Supervised] = field(default_factory=dict)
    # One of several processes of this replica (router.processes); None: the only one.
    process: ProcessSlot | None = None
    _store: DrainStore | None = None
    _redis: Redis | None = None
    _fleet: FleetCollector | None = None
    _own_metrics: asyncio.AbstractServer | None = None
    _kept: Kept | None = None  # (several processes: router.telemetry.machine)
    _watcher: ConfigWatcher | None = None
    _signal_reloads: set[asyncio.Task[None]] = field(default_factory=set)  # SIGHUP's, running

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(self.registry, lambda: self.configs.current.models)

    @classmethod
    def create(cls, config: GlobalConfig, *, config_path: Path | None, region: str | None,
               policy_override: str | None = None,
               tracer_provider: ApiTracerProvider | None = None,
               process: ProcessSlot | None = None) -> Operations:
        owns = tracer_provider is None
        provider = tracer_provider if tracer_provider is not None else tracer_provider_from_env()
        return cls(configs=initial_holder(config, config_path), region=region,
                   policy_override=policy_override, tracer_provider=provider,
                   owns_tracer_provider=owns and provider is not None, process=process)

    def inference(self, proxy: Proxy) -> InferenceHandler:
        """The proxy's inference handler, each request in its own span when tracing."""
        if self.tracer_provider is None:
            return proxy.inference
        return traced(self.tracer_provider, proxy.inference)

    @property
    def observers(self) -> tuple[Observer, ...]:
        observers: list[Observer] = [self.metrics, self.window]
        if self.tracer_provider is not None:
            observers.append(SpanAnnotator(self.tracer_provider))
        return tuple(observers)

    def add_routes(self, app: web.Application) -> None:
        auth = AdminAuth(lambda: self.configs.current.admin.token_env)
        add_admin_routes(app, auth)
        scrape = AdminAuth(lambda: self._metrics_token_env() or "")
        serve_metrics = metrics_handler(
            self.registry, self._worker_exposition,
            machine=self._machine_metrics if self.process is not None else None)

        async def metrics(request: web.Request) -> web.Response:
            """/metrics, behind the token `admin.metrics_auth` asks for (none by default)."""
            if self._metrics_token_env() is not None:
                scrape.check(request)
            return await serve_metrics(request)

        app.router.add_get("/metrics", metrics)

    async def start(self, app: web.Application, *, redis_url: str, proxy: Proxy,
                    snapshots: SnapshotHolder, inflight: InFlight,
                    security: SecurityStats | None = None,
                    heartbeat_counts: Callable[[], Mapping[str, int]] | None = None,
                    heartbeat_upkeep: Callable[[], Mapping[str, float]] | None = None,
                    background: Callable[[], Mapping[str, tuple[bool, int]]] | None = None,
                    heartbeat_keys: Mapping[str, bytes] | None = None,
                    batches: BatchRunner | None = None) -> None:
        """Begin following drain flags and the config file; expose the admin context."""
        config = self.configs.current
        self.drains.set_configured(_configured_drains(config))
        redis = self._redis = redis_client.connect(redis_url, max_connections=4)
        store = DrainStore(redis, DrainKeys(redis_client.one_slot_prefix(
                               config.redis.key_prefix, redis_url)), self.drains,
                           on_restored=self._drains_restored, signing_keys=heartbeat_keys)
        self._store = store
        await store.refresh()
        self.supervised["drain-flags"] = Supervised("drain-flags", store.run).start()
        watcher: ConfigWatcher | None = None
        if self.configs.path is not None:
            watcher = ConfigWatcher(self.configs, self.configs.path, router_region=self.region,
                                    interval_s=lambda: self.configs.current.admin.config_check_s,
                                    extra_checks=self._policy_known)
            self.supervised["config-watcher"] = Supervised("config-watcher", watcher.run).start()
        self._watcher = watcher
        self.configs.on_swap(lambda old, new: self._swapped(proxy, old, new))
        self.configs.on_refused(self._refused)
        self._fleet = FleetCollector(
            snapshots=snapshots, configs=self.configs, drains=self.drains, inflight=inflight,
            health=proxy.health, retry_budget=proxy.retry_budget,
            hedge_budget=proxy.hedges.budget,
            queue=proxy.queue.backlog if proxy.queue is not None else None,
            upstream_stats=proxy.upstreams.stats, heartbeat_counts=heartbeat_counts,
            heartbeat_upkeep=heartbeat_upkeep, background=background)
        self.registry.register(self._fleet)
        if security is not None:
            self.registry.register(SecurityCollector(security))
        if proxy.responses is not None:
            self.registry.register(ResponsesCollector(proxy.responses.store.stats))
        if batches is not None:
            self.registry.register(BatchCollector(batches))
        app[ADMIN] = AdminContext(
            region=self.region, configs=self.configs, snapshots=snapshots,
            drain_holder=self.drains, inflight=inflight, window=self.window,
            events=self.events, drains=store, health=proxy.health,
            reload=watcher.reload if watcher is not None else None,
            reload_siblings=(self.process.tell_siblings_to_reload
                             if self.process is not None else None),
            queue=proxy.queue.backlog if proxy.queue is not None else None,
            heartbeat_keys=None if heartbeat_keys is None else bool(heartbeat_keys),
            batches=batches.status if batches is not None else None)
        if self.process is not None:
            registry = self.registry
            process = self.process
            kept = self._kept = Kept(process.directory, process.index, process.count,
                                     process.starts)
            kept.fold()
            self._own_metrics = await serve_own(process.metrics_socket(),
                                                lambda: kept.note(generate_latest(registry)))

    def reload_on_signal(self) -> None:
        """SIGHUP: read regions.yaml again now, as POST /admin/reload does (in this process
        only: the supervisor sends it to each, router.processes). The reload runs as a task:
        the file is parsed in a thread while the loop serves."""
        watcher = self._watcher
        if watcher is None:
            log.warning("SIGHUP: this router was not started from a config file (or is "
                        "still starting): nothing to reload")
            return

        async def reload() -> None:
            taken = await watcher.reload()
            log.info("SIGHUP: regions.yaml %s",
                     "reloaded" if taken else "not changed or refused")

        task = asyncio.get_running_loop().create_task(reload(), name="sighup-reload")
        self._signal_reloads.add(task)
        task.add_done_callback(self._signal_reloads.discard)

    async def _machine_metrics(self, own: bytes) -> bytes:
        """`own` metrics merged with the sibling processes' (router.telemetry.machine)."""
        process, kept = self.process, self._kept
        assert process is not None and kept is not None
        answers = iter(await read_siblings(process.sibling_sockets()))
        siblings = [None if index == process.index else next(answers)
                    for index in range(process.count)]
        kept.note(own)
        return merge(own, [text for text in siblings if text is not None], process.count,
                     kept.missing([index == process.index or text is not None
                                   for index, text in enumerate(siblings)]))

    async def _worker_exposition(self) -> bytes:
        """The fleet's gauges by worker, once the fleet is followed (`start`)."""
        return await self._fleet.worker_exposition() if self._fleet is not None else b""

    def _drains_restored(self, records: list[DrainRecord]) -> None:
        for record in records:
            self.events.record("drain_restored", f"{record.kind} {record.name}",
                               "Redis came back without the drain flag; this router wrote "
                               "it back")

    async def stop(self) -> None:
        for task in list(self._signal_reloads):
            task.cancel()
        if self._own_metrics is not None:
            self._own_metrics.close()
        await asyncio.gather(*(task.stop() for task in self.supervised.values()))
        if self._redis is not None:
            await self._redis.aclose()
        if self.owns_tracer_provider and isinstance(self.tracer_provider, TracerProvider):
            # Flushes the spans still queued. The SDK's export is a blocking HTTP call made
            # from its own thread; wait for it off the loop so the loop keeps serving.
            await asyncio.get_running_loop().run_in_executor(None, self.tracer_provider.shutdown)

    def _swapped(self, proxy: Proxy, old: GlobalConfig, new: GlobalConfig) -> None:
        self.drains.set_configured(_configured_drains(new))
        self.events.record("config_reloaded", f"version {self.configs.version}",
                           ", ".join(f"{name} needs a restart"
                                     for name in self.configs.restart_required))
        name = self.policy_override or new.router.policy
        if name == (self.policy_override or old.router.policy) and (
                new.router.near_equal_ms == old.router.near_equal_ms):
            return
        try:
            context = dataclasses.replace(proxy.policy.context,
                                          near_equal_ms=new.router.near_equal_ms)
            proxy.policy = create_policy(name, context)
        except ValueError as exc:  # an unknown policy name: keep the one in force
            log.error("config %s: router.policy: %s; keeping %s", self.configs.version, exc,
                      proxy.policy.name)
            return
        log.info("routing policy now %s (near_equal_ms %g)", name, new.router.near_equal_ms)

    def _metrics_token_env(self) -> str | None:
        """The variable holding the token /metrics asks for; None: it asks for none."""
        admin = self.configs.current.admin
        if admin.metrics_auth == "admin_token":
            return admin.token_env
        if admin.metrics_auth == "scrape_token":
            return admin.scrape_token_env
        return None

    def _policy_known(self, config: GlobalConfig) -> list[str]:
        return runtime_problems(config, policy_override=self.policy_override)

    def _refused(self, error: ReloadError) -> None:
        # The problems are already bounded (router.config_reload.bounded_problems); the
        # event keeps the first few, as the status keeps its last 50 events.
        shown = error.problems[:EVENT_PROBLEMS]
        more = len(error.problems) - len(shown)
        self.events.record("config_refused", str(self.configs.path or "regions.yaml"),
                           "; ".join(shown) + (f"; ... {more} more in config.last_error"
                                               if more else ""))


def _configured_drains(config: GlobalConfig) -> frozenset[str]:
    return frozenset(name for name, region in config.regions.items() if region.drain)
