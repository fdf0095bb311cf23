"""GET /admin/status: the fleet as this router sees it, as one JSON document.

Read-only and built from in-memory state only (snapshot, drain flags, passive health, the
last minute of traffic): it never awaits Redis, so it answers even while Redis is down
and says so (`redis.connected`, `redis.snapshot_age_s`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sized
from dataclasses import dataclass, field
from typing import Any, Protocol

from router.admin.events import EventLog
from router.config_reload import ConfigHolder
from router.registry.drains import DrainHolder, DrainStore
from router.registry.inflight import InFlight
from router.registry.snapshot import Snapshot, SnapshotHolder
from router.registry.worker_view import WorkerView
from router.telemetry.window import RegionTraffic, TrafficWindow
from worker.schema import LifecycleState

MAX_EVENTS = 50
# Workers described, and encoded, between two turns of the event loop (~2-4 ms): a fleet
# of 10,000 took ~0.3 s in one go (the status page asks every second), and every request
# the router had waited for it.
WORKERS_PER_TURN = 250
# Workers looked at (status, breaker, drain: what the regions' summaries need) between two
# turns: each is a few attribute reads, a quarter of describing one.
WORKERS_SEEN_PER_TURN = 1000


class HealthEventView(Protocol):
    """An ejection or readmission (router.health.HealthEvent); `at_s` is monotonic."""

    @property
    def at_s(self) -> float: ...
    @property
    def worker_id(self) -> str: ...
    @property
    def region(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def detail(self) -> str: ...


class HealthStatusView(Protocol):
    """What the status reads of passive health (router.health.Health)."""

    @property
    def events(self) -> Iterable[HealthEventView]: ...

    def state_of(self, worker_id: str) -> object: ...

    def region_penalties(self, now_s: float) -> dict[str, float]: ...


@dataclass
class AdminContext:
    """Everything the admin API and the status page read; wired by router.app."""

    region: str | None
    configs: ConfigHolder
    snapshots: SnapshotHolder
    drain_holder: DrainHolder
    inflight: InFlight
    window: TrafficWindow
    events: EventLog
    drains: DrainStore | None = None
    health: HealthStatusView | None = None
    reload: Callable[[], Awaitable[bool]] | None = None
    # Asks this replica's other processes to reload too (router.processes); None: none.
    reload_siblings: Callable[[], None] | None = None
    queue: Sized | None = None  # requests waiting at this router (router.admission.queue)
    # Whether this router has heartbeat signing keys (None: not known here).
    heartbeat_keys: bool | None = None
    # The unfinished batches and this replica's share (router.batch.runner); None: none.
    batches: Callable[[], dict[str, Any]] | None = None
    started_unix_s: float = field(default_factory=time.time)
    clock: Callable[[], float] = time.monotonic


def _signing(context: AdminContext) -> str | None:
    """"required" (signing keys), "insecure" (no keys, heartbeat.insecure: unsigned ones
    believed) or "no_keys" (every heartbeat refused)."""
    if context.heartbeat_keys is None:
        return None
    if context.heartbeat_keys:
        return "required"
    return "insecure" if context.configs.current.heartbeat.insecure else "no_keys"


def _breaker(context: AdminContext, worker_id: str) -> str:
    if context.health is None:
        return "closed"
    return str(context.health.state_of(worker_id))


@dataclass(frozen=True, slots=True)
class _Seen:
    """What routing makes of one worker now: all that a region's summary needs of it, and
    whether it is a problem (listed first when the document lists only some workers)."""

    view: WorkerView
    status: str  # ready, drained, ejected, stale, or the state the worker reports
    drained: bool
    fresh: bool
    breaker: str

    @property
    def problem(self) -> bool:
        return self.status != LifecycleState.READY.value or self.breaker != "closed"


def _seen(context: AdminContext, view: WorkerView, freshness_now: float) -> _Seen:
    drained = context.drain_holder.current.covers(view)
    fresh = view.fresh(freshness_now)
    breaker = _breaker(context, view.worker_id)
    if drained:
        status = "drained"
    elif not fresh:
        status = "stale"
    elif breaker == "open":
        status = "ejected"
    else:
        status = view.heartbeat.state.value
    return _Seen(view, status, drained, fresh, breaker)


def _worker(context: AdminContext, seen: _Seen, now_s: float) -> dict[str, Any]:
    view = seen.view
    heartbeat = view.heartbeat
    status, drained, fresh, breaker = seen.status, seen.drained, seen.fresh, seen.breaker
    return {
        "id": view.worker_id,
        "region": view.region,
        "status": status,  # what routing makes of it: ready, drained, ejected, stale, ...
        "state": heartbeat.state.value,  # what the worker reports
        "drained": drained,
        "breaker": breaker,
        "fresh": fresh,
        "heartbeat_age_s": round(max(0.0, now_s - view.received_at_s), 3),
        "endpoint": view.endpoint,
        "models": list(heartbeat.models),
        "capacity": {"max_num_seqs": heartbeat.capacity.max_num_seqs,
                     "kv_blocks": heartbeat.capacity.kv_blocks_total},
        "load": {"running": view.running, "waiting": view.waiting,
                 "kv_cache_usage": view.kv_cache_usage,
                 "router_inflight": context.inflight.own_of(view.worker_id)},
        "performance": {"ttft_ms": view.ttft_ms, "itl_ms": view.itl_ms,
                        "e2e_ms": view.e2e_ms},
        "engine": {"kind": heartbeat.engine.kind, "version": heartbeat.engine.version,
                   # set while its agent says the engine holds requests and runs no step
                   "stuck_for_s": heartbeat.engine.stuck_for_s},
    }


def _region(context: AdminContext, name: str, workers: list[_Seen],
            drained: bool) -> dict[str, Any]:
    config = context.configs.current
    spec = config.regions.get(name)
    routable = [w for w in workers if w.status == LifecycleState.READY.value]
    live = [w.view for w in workers if w.fresh]
    if drained:
        health = "drained"
    elif not routable:
        health = "down"
    elif len(routable) < len(workers):
        health = "degraded"
    else:
        health = "ok"
    by_status: dict[str, int] = {}
    for worker in workers:
        by_status[worker.status] = by_status.get(worker.status, 0) + 1
    kv = [v.kv_cache_usage for v in live if v.kv_cache_usage is not None]
    capacity = sum(v.heartbeat.capacity.max_num_seqs for v in live)
    load = sum(v.running + v.waiting for v in live)
    return {
        "name": name,
        "configured": spec is not None,
        "models": list(spec.models) if spec is not None else [],
        "rtt_ms": config.rtt_ms(context.region, name) if context.region else None,
        "drained": drained,
        "health": health,
        "workers": by_status,
        "capacity_seqs": capacity,
        "load_seqs": load,
        "utilization": round(load / capacity, 3) if capacity else None,
        "kv_cache_usage": round(sum(kv) / len(kv), 3) if kv else None,
        "router_inflight": sum(context.inflight.own_of(w.view.worker_id) for w in workers),
    }


def _events(context: AdminContext, now_s: float, now_unix_s: float) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = [{"at_unix_s": e.at_unix_s, "kind": e.kind, "subject": e.subject,
               "detail": e.detail} for e in context.events.recent()]
    if context.health is not None:
        events += [{"at_unix_s": now_unix_s - (now_s - e.at_s), "kind": e.kind,
                    "subject": f"worker {e.worker_id} ({e.region})", "detail": e.detail}
                   for e in context.health.events]
    events.sort(key=lambda e: float(e["at_unix_s"]), reverse=True)
    return events[:MAX_EVENTS]


async def fleet_status(context: AdminContext, max_workers: int | None = None
                       ) -> dict[str, Any]:
    """The document; workers are looked at WORKERS_SEEN_PER_TURN and described
    WORKERS_PER_TURN at a time, with the event loop running in between (all of one
    snapshot; their breakers and open requests as they are when each is looked at).
    Regions summarise every worker;
    `max_workers` lists at most that many, problems first (not ready, or a breaker not
    closed), then by region and id: a status page of a 10,000-worker fleet need not
    carry every one of them every second."""
    now_s = context.clock()
    now_unix_s = time.time()
    snapshot = context.snapshots.current
    seen = await _look_at_workers(context, snapshot, now_s)
    workers = await _describe_workers(context, _listed(seen, max_workers), now_s)
    traffic = context.window.summary()
    unrouted = traffic.get("none")
    age = snapshot.view_age_s(now_s)
    return {
        "router": {"region": context.region,
                   "uptime_s": round(now_unix_s - context.started_unix_s, 1),
                   "now_unix_s": round(now_unix_s, 3),
                   # the other replicas whose open requests this one counts: {id: open}
                   "peers": context.inflight.peers(),
                   "queued": len(context.queue) if context.queue is not None else 0},
        "config": _config(context),
        "redis": {"connected": snapshot.redis_connected,
                  "snapshot_age_s": None if age is None else round(age, 3)},
        "regions": _regions(context, seen, traffic, now_s),
        "workers_total": len(seen),  # `workers` lists them all, or max_workers of them
        "workers": workers,
        "unrouted": None if unrouted is None else {
            "requests": unrouted.requests, "errors": unrouted.errors, "share": unrouted.share},
        "drains": _drains(context),
        "events": _events(context, now_s, now_unix_s),
        "security": {"heartbeat_signing": _signing(context),
                     # drain flags read that no heartbeat key signed (forged, or older)
                     "drain_flags_not_signed": (context.drains.forged_total
                                                if context.drains is not None else 0)},
        "batches": context.batches() if context.batches is not None else None,
    }


async def _look_at_workers(context: AdminContext, snapshot: Snapshot, now_s: float
                           ) -> list[_Seen]:
    """Every worker of `snapshot`, by region and id, looked at WORKERS_SEEN_PER_TURN at a
    time."""
    freshness_now = snapshot.freshness_now(now_s)
    views = sorted(snapshot.workers.values(), key=lambda v: (v.region, v.worker_id))
    seen: list[_Seen] = []
    for start in range(0, len(views), WORKERS_SEEN_PER_TURN):
        if start:
            await asyncio.sleep(0)
        seen += [_seen(context, view, freshness_now)
                 for view in views[start:start + WORKERS_SEEN_PER_TURN]]
    return seen


def _listed(seen: list[_Seen], max_workers: int | None) -> list[_Seen]:
    """The workers the document lists: all, or `max_workers` of them, problems first."""
    if max_workers is None or max_workers >= len(seen):
        return seen
    listed = [w for w in seen if w.problem][:max_workers]
    return listed + [w for w in seen if not w.problem][:max_workers - len(listed)]


async def _describe_workers(context: AdminContext, listed: list[_Seen], now_s: float
                            ) -> list[dict[str, Any]]:
    workers: list[dict[str, Any]] = []
    for start in range(0, len(listed), WORKERS_PER_TURN):
        if start:
            await asyncio.sleep(0)
        workers += [_worker(context, w, now_s) for w in listed[start:start + WORKERS_PER_TURN]]
    return workers


def _regions(context: AdminContext, seen: list[_Seen], traffic: Mapping[str, RegionTraffic],
             now_s: float) -> list[dict[str, Any]]:
    """Each region of regions.yaml, then any other that workers name: its workers'
    summary, drain, latency penalty and the last minute's traffic."""
    in_region: dict[str, list[_Seen]] = {}
    for w in seen:
        in_region.setdefault(w.view.region, []).append(w)
    drained = context.drain_holder.current
    names = list(context.configs.current.regions)
    names += sorted(set(in_region) - set(names))
    penalties = context.health.region_penalties(now_s) if context.health is not None else {}
    regions = []
    for name in names:
        region = _region(context, name, in_region.get(name, []), name in drained.regions)
        # added to the region's predicted TTFTs: its first bytes came late (router.health)
        region["latency_penalty_ms"] = round(penalties.get(name, 0.0), 1)
        recent = traffic.get(name)
        region["traffic"] = None if recent is None else {
            "requests": recent.requests, "errors": recent.errors, "share": recent.share,
            "ttft_p50_ms": recent.ttft_p50_ms, "ttft_p99_ms": recent.ttft_p99_ms,
            "e2e_p50_ms": recent.e2e_p50_ms, "e2e_p99_ms": recent.e2e_p99_ms,
        }
        regions.append(region)
    return regions


def _config(context: AdminContext) -> dict[str, Any]:
    configs = context.configs
    error = configs.last_error
    return {
        "path": str(configs.path) if configs.path else None,
        "version": configs.version,
        "loaded_at_unix_s": round(configs.loaded_at_unix_s, 3),
        "reloads": configs.reloads,
        "reload_errors": configs.reload_errors,
        "restart_required": list(configs.restart_required),
        "last_error": None if error is None else {
            "at_unix_s": round(error.at_unix_s, 3), "problems": list(error.problems)},
    }


def _drains(context: AdminContext) -> list[dict[str, Any]]:
    """Drains set at run time (oldest first), then the regions regions.yaml drains."""
    holder = context.drain_holder
    return [
        {"kind": r.kind, "name": r.name, "since_unix_s": r.since_unix_s,
         "reason": r.reason, "by": r.by}
        for r in sorted(holder.records.values(), key=lambda r: r.since_unix_s)
    ] + [
        {"kind": "region", "name": name, "since_unix_s": context.configs.loaded_at_unix_s,
         "reason": "drain: true in regions.yaml", "by": "config"}
        for name in sorted(holder.configured)
    ]


async def status_json(context: AdminContext, max_workers: int | None = None) -> bytes:
    """`fleet_status` as JSON, its workers encoded WORKERS_PER_TURN at a time (with the
    event loop running in between) and written last."""
    status = await fleet_status(context, max_workers)
    workers = status.pop("workers")
    encoded = []
    while workers:
        await asyncio.sleep(0)
        encoded.append(json.dumps(workers[:WORKERS_PER_TURN])[1:-1])
        del workers[:WORKERS_PER_TURN]  # freed as they go, not all at once (~10 ms)
    head = json.dumps(status)
    return f'{head[:-1]}, "workers": [{", ".join(encoded)}]}}'.encode()
