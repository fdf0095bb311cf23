"""The state of the fleet and of this router as Prometheus reads it at scrape time
(`FleetCollector`): from the snapshot, the drain flags, passive health, the config holder,
the router queue, the upstream pool and the heartbeat collector. The per-worker gauges of
a large fleet are written directly (`worker_exposition`), a turn of the event loop at a
time."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from router.admission.queue import Backlog
from router.config_reload import ConfigHolder
from router.registry.drains import DrainHolder
from router.registry.inflight import InFlight
from router.registry.refusals import REFUSED_COUNT_PREFIX
from router.registry.snapshot import SnapshotHolder


class HealthView(Protocol):
    """What the telemetry reads of passive health (router.health.Health)."""

    ejections_total: int

    def state_of(self, worker_id: str) -> object: ...

    def region_penalties(self, now_s: float) -> dict[str, float]: ...


class RetryBudgetView(Protocol):
    denied: int


class HedgeBudgetView(Protocol):
    denied: int
    refunded: int


@dataclass(eq=False)  # hashable by identity: the registry keys collectors by it
class FleetCollector:
    """Scrape-time gauges of the fleet view and of this router (a prometheus Collector)."""

    snapshots: SnapshotHolder
    configs: ConfigHolder
    drains: DrainHolder
    inflight: InFlight
    health: HealthView | None = None
    retry_budget: RetryBudgetView | None = None
    hedge_budget: HedgeBudgetView | None = None
    queue: Backlog[Any] | None = None
    # The upstream pool's {"opened", "reused", "idle", "warmed"} (router.proxy.upstream.pool).
    upstream_stats: Callable[[], Mapping[str, int]] | None = None
    # The heartbeat collector's counts (router.registry.HeartbeatCollector.counts).
    heartbeat_counts: Callable[[], Mapping[str, int]] | None = None
    # What keeping the fleet view costs (router.registry.HeartbeatCollector.upkeep).
    heartbeat_upkeep: Callable[[], Mapping[str, float]] | None = None
    # The supervised background tasks: name -> (running, crashes) (router.supervisor).
    background: Callable[[], Mapping[str, tuple[bool, int]]] | None = None
    clock: Callable[[], float] = time.monotonic

    def collect(self) -> Iterator[Metric]:
        now_s = self.clock()
        yield from self._view(now_s)
        yield from self._queue()
        yield from self._peers()
        yield from self._config()
        yield self._drained()
        if self.background is not None:
            yield from _background_tasks(self.background())
        yield from self._health(now_s)
        yield from self._upstream()
        yield from self._heartbeats()
        yield from self._upkeep()

    def _view(self, now_s: float) -> Iterator[Metric]:
        snapshot = self.snapshots.current
        yield _gauge("globalpool_redis_connected", "1 while the router can read Redis.",
                     1.0 if snapshot.redis_connected else 0.0)
        age = snapshot.view_age_s(now_s)
        yield _gauge("globalpool_snapshot_age_seconds",
                     "Seconds since Redis last answered the router (fleet view age).",
                     age if age is not None else float("nan"))
        yield _gauge("globalpool_inflight_requests", "Requests this router has open upstream.",
                     float(self.inflight.own_total()))
        states: dict[str, int] = {}
        for view in snapshot.workers.values():
            state = view.heartbeat.state.value
            states[state] = states.get(state, 0) + 1
        in_view = GaugeMetricFamily(
            "globalpool_fleet_view_workers", "Workers in this process's fleet view, by "
            "state (with --processes N, each process's own: router.registry.mirror).",
            labels=["state"])
        for state, count in sorted(states.items()):
            in_view.add_metric([state], float(count))
        yield in_view

    def _queue(self) -> Iterator[Metric]:
        if self.queue is None:
            return
        yield _gauge("globalpool_queued_requests",
                     "Requests waiting at this router for a worker with room.",
                     float(len(self.queue)))
        left = CounterMetricFamily(
            "globalpool_queue_exits", "Requests that waited at this router, by how the "
            "wait ended (room: a worker had room; deadline: sent anyway; full: refused).",
            labels=["outcome"])
        left.add_metric(["room"], float(self.queue.dispatched))
        left.add_metric(["deadline"], float(self.queue.expired))
        left.add_metric(["full"], float(self.queue.refused))
        yield left

    def _peers(self) -> Iterator[Metric]:
        peers = self.inflight.peers()
        yield _gauge("globalpool_peer_routers",
                     "Other router replicas whose open requests this one counts.",
                     float(len(peers)))
        yield _gauge("globalpool_peer_inflight_requests",
                     "Requests the other router replicas reported open upstream.",
                     float(sum(peers.values())))

    def _drained(self) -> Metric:
        drained = GaugeMetricFamily("globalpool_drained", "1 for each drained region or worker.",
                                    labels=["kind", "name"])
        for record in self.drains.records.values():
            drained.add_metric([record.kind, record.name], 1.0)
        for name in self.drains.configured:  # `drain: true` in regions.yaml
            drained.add_metric(["region", name], 1.0)
        return drained

    def _health(self, now_s: float) -> Iterator[Metric]:
        if self.health is not None:
            yield _counter("globalpool_ejections", "Workers ejected by passive health.",
                           float(self.health.ejections_total))
            penalties = GaugeMetricFamily(
                "globalpool_region_latency_penalty_ms", "What this router adds to a region's "
                "predicted TTFT because its first bytes came later than predicted, beyond "
                "the other regions' (0: as predicted).", labels=["region"])
            for region, penalty_ms in sorted(self.health.region_penalties(now_s).items()):
                penalties.add_metric([region], penalty_ms)
            yield penalties
        if self.retry_budget is not None:
            yield _counter("globalpool_retry_budget_denied",
                           "Retries not made because the retry budget was spent.",
                           float(self.retry_budget.denied))
        if self.hedge_budget is not None:
            yield _counter("globalpool_hedges_denied",
                           "Streams that would have been hedged but for the hedging budget "
                           "(router.hedging.max_fraction).", float(self.hedge_budget.denied))
            yield _counter("globalpool_hedges_refunded",
                           "Copies that answered first, given back to the hedging budget (the "
                           "budget bounds the copies that lose).",
                           float(self.hedge_budget.refunded))

    def _upstream(self) -> Iterator[Metric]:
        if self.upstream_stats is None:
            return
        stats = self.upstream_stats()
        yield _counter("globalpool_upstream_connections_opened",
                       "Connections this router opened to workers.",
                       float(stats["opened"]))
        yield _counter("globalpool_upstream_connections_reused",
                       "Requests sent on a kept-alive connection to a worker.",
                       float(stats["reused"]))
        yield _counter("globalpool_upstream_connections_warmed",
                       "Of the connections opened, those opened ahead of a hedged copy "
                       "(router.hedging: to where copies would go now).",
                       float(stats["warmed"]))
        yield _gauge("globalpool_upstream_idle_connections",
                     "Kept-alive connections to workers waiting for a request.",
                     float(stats["idle"]))

    def _heartbeats(self) -> Iterator[Metric]:
        if self.heartbeat_counts is None:
            return
        refused = CounterMetricFamily(
            "globalpool_heartbeats_refused", "Heartbeats and load records refused, by "
            "reason (malformed_json, oversize, unknown_field, invalid:<field path>, "
            "worker_id_mismatch, order_mismatch, wrong_region); they sum to "
            "globalpool_heartbeats_malformed_total.", labels=["reason"])
        for name, value in self.heartbeat_counts().items():
            if name.startswith(REFUSED_COUNT_PREFIX):
                refused.add_metric([name[len(REFUSED_COUNT_PREFIX):]], float(value))
                continue
            documentation = _HEARTBEAT_COUNTS.get(name)
            if documentation is not None:
                yield _counter(f"globalpool_{name}", documentation, float(value))
        yield refused

    def _upkeep(self) -> Iterator[Metric]:
        if self.heartbeat_upkeep is None:
            return
        upkeep = self.heartbeat_upkeep()
        yield _counter("globalpool_fleet_view_cpu_seconds",
                       "CPU seconds spent parsing, checking and applying heartbeats and "
                       "load records and building fleet snapshots (its rate is the share "
                       "of a core that keeping the view takes; Redis reads not included).",
                       upkeep["cpu_seconds"])
        yield _counter("globalpool_fleet_view_builds", "Fleet snapshots built.",
                       upkeep["builds"])
        yield _gauge("globalpool_fleet_view_rebuild_interval_seconds",
                     "Least time between two snapshot builds and load record reads now: "
                     "20 ms, up to 0.5 s for a fleet whose view costs more to build.",
                     upkeep["rebuild_interval_seconds"])

    async def worker_exposition(self) -> bytes:
        """The gauges with a sample per worker (WORKER_GAUGES) and the count of workers by
        region and state, in Prometheus' text format as prometheus_client writes them, but
        written here: through prometheus_client a scrape of 10,000 workers (40,000
        samples) took ~0.4 s, and the event loop, with every request, waited for it. This
        takes ~1 us a sample, WORKERS_PER_TURN workers at a time with the event loop
        running in between (the snapshot never changes, so the text is of one moment)."""
        snapshot = self.snapshots.current
        freshness_now = snapshot.freshness_now(self.clock())
        per_worker = self.configs.current.router.worker_metrics
        by_state: dict[tuple[str, str], int] = {}
        stuck: dict[str, int] = {}  # region -> workers whose agent says the engine is stuck
        samples: tuple[list[str], ...] = ([], [], [], [])
        capacity, load, itl, ttft = samples
        regions: dict[str, str] = {}  # region -> its escaped label value
        for count, view in enumerate(snapshot.workers.values(), start=1):
            state = view.heartbeat.state.value if view.fresh(freshness_now) else "stale"
            key = (view.region, state)
            by_state[key] = by_state.get(key, 0) + 1
            if view.heartbeat.engine.stuck_for_s is not None:
                stuck[view.region] = stuck.get(view.region, 0) + 1
            if not per_worker:
                continue  # router.worker_metrics: false (a count is ~0.3 us; no pauses)
            region = regions.get(view.region)
            if region is None:
                region = regions[view.region] = _label_value(view.region)
            labels = f'{{region="{region}",worker="{_label_value(view.worker_id)}"}} '
            capacity.append(labels + _number(view.slots))
            load.append(labels + _number(view.reported_load))
            if view.itl_ms is not None:
                itl.append(labels + _number(view.itl_ms / 1000.0))
            if view.ttft_ms is not None:
                ttft.append(labels + _number(view.ttft_ms / 1000.0))
            if count % WORKERS_PER_TURN == 0:
                await asyncio.sleep(0)
        counts = [f'{{region="{_label_value(region)}",state="{state}"}} {float(count)!r}'
                  for (region, state), count in sorted(by_state.items())]
        stuck_counts = [f'{{region="{_label_value(region)}"}} {float(stuck.get(region, 0))!r}'
                        for region in sorted({region for region, _ in by_state})]
        families = list(zip(WORKER_GAUGES, (counts, stuck_counts, *samples), strict=True))
        return "".join(_family(name, documentation, lines) for (name, documentation), lines
                       in (families if per_worker else families[:2])).encode()

    def _config(self) -> Iterator[Metric]:
        configs = self.configs
        info = GaugeMetricFamily("globalpool_config_info", "The regions.yaml version in force.",
                                 labels=["version"])
        info.add_metric([configs.version], 1.0)
        yield info
        yield _counter("globalpool_config_reloads", "regions.yaml reloads taken.",
                       float(configs.reloads))
        yield _counter("globalpool_config_reload_errors",
                       "regions.yaml reloads refused (invalid file; last good config kept).",
                       float(configs.reload_errors))
        yield _gauge("globalpool_config_last_reload_ok",
                     "0 while the file on disk is refused (an older config is in force).",
                     0.0 if configs.last_error is not None else 1.0)


# Gauges of FleetCollector.worker_exposition: workers by region and state, those whose
# engine is stuck by region, then a sample per worker (region and worker labels).
WORKER_GAUGES = (
    ("globalpool_workers", "Workers known, by region and state."),
    ("globalpool_workers_engine_stuck", "Workers whose agent says their engine holds "
     "requests and has run no step for heartbeat.stuck_after_s (a wedged accelerator), "
     "by region."),
    ("globalpool_worker_capacity_seqs", "Sequences a worker runs at once (heartbeat)."),
    ("globalpool_worker_load_seqs", "Sequences running + waiting on a worker (heartbeat)."),
    ("globalpool_worker_itl_seconds", "Inter-token latency a worker reports (heartbeat)."),
    ("globalpool_worker_ttft_seconds", "Time to first token a worker reports (heartbeat)."),
)


# Workers written to /metrics between two turns of the event loop (~1-2 ms).
WORKERS_PER_TURN = 1000


def _background_tasks(tasks: Mapping[str, tuple[bool, int]]) -> Iterator[Metric]:
    up = GaugeMetricFamily("globalpool_background_task_up",
                           "1 while the background task runs (0: crashed, restarting).",
                           labels=["task"])
    crashes = CounterMetricFamily("globalpool_background_task_crashes",
                                  "Crashes of the background task (each was restarted).",
                                  labels=["task"])
    for name, (running, crashed) in sorted(tasks.items()):
        up.add_metric([name], 1.0 if running else 0.0)
        crashes.add_metric([name], float(crashed))
    yield up
    yield crashes


def _family(name: str, documentation: str, samples: list[str]) -> str:
    """A gauge family in the text format: help, type, then `name` + each sample."""
    head = f"# HELP {name} {documentation}\n# TYPE {name} gauge\n"
    return head + "".join(f"{name}{sample}\n" for sample in samples)


def _label_value(text: str) -> str:
    """A label value escaped as Prometheus' text format (and prometheus_client) escape it."""
    if "\\" in text or "\n" in text or '"' in text:
        return text.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')
    return text


def _number(value: float) -> str:
    """A sample value as prometheus_client writes it (`floatToGoString`): `repr` but for
    infinities, NaN and large numbers, which are rare here."""
    value = float(value)
    if 0.0 <= value < 1e6:
        return repr(value)
    text: str = floatToGoString(value)  # type: ignore[no-untyped-call]
    return text


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


_HEARTBEAT_COUNTS = {
    "heartbeat_messages": "Messages received on the routers' heartbeat channel.",
    "heartbeats_parsed": "Full heartbeats parsed and checked (messages, full reads, keys).",
    "heartbeats_malformed": "Heartbeats and load records refused as malformed or misplaced.",
    "load_records_read": "Load records read that had changed since the last read.",
    "load_records_applied": "Load records taken into the fleet view.",
    "heartbeat_key_reads": "Worker keys read because a load record named an unknown worker "
                           "or a changed heartbeat.",
    "load_record_reads": "Reads of every region's load records (one round trip each).",
    "fleet_view_frames_mirrored": "Frames of the first router process's fleet view taken "
                                  "by this one (--processes N).",
    "fleet_view_own_reads": "Times this router process began reading Redis itself because "
                            "the first process's fleet view could not be had.",
}


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)
