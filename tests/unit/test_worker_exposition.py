"""The per-worker gauges on /metrics, written directly: the same text prometheus_client
writes for the same samples, and readable by Prometheus' parser."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from router.config import GlobalConfig
from router.config_reload import ConfigHolder
from router.registry.drains import DrainHolder
from router.registry.inflight import InFlight
from router.registry.snapshot import Snapshot, SnapshotHolder
from router.registry.worker_view import WorkerView
from router.telemetry.fleet import WORKER_GAUGES, FleetCollector
from tests.unit.loop_turns import with_turns
from worker.schema import Capacity, EngineInfo, Heartbeat, LifecycleState, Load, Performance

NOW = 10.0  # the snapshot's: Redis last answered then


def view(worker_id: str, region: str, *, slots: int = 8, running: int = 0,
         itl_ms: float | None = None, ttft_ms: float | None = None,
         state: LifecycleState = LifecycleState.READY, received_at_s: float = 10.0,
         stuck_for_s: float | None = None) -> WorkerView:
    return WorkerView(Heartbeat(
        worker_id=worker_id, region=region, endpoint="http://127.0.0.1:1", models=("m",),
        state=state, capacity=Capacity(max_num_seqs=slots),
        load=Load(running=running, waiting=1, kv_cache_usage=None),
        performance=Performance(itl_ms=itl_ms, ttft_ms=ttft_ms),
        engine=EngineInfo(stuck_for_s=stuck_for_s),
        seq=1, sent_at_s=1.0, ttl_s=2.0), received_at_s=received_at_s)


class PrometheusClientWay:
    """The same gauges as GaugeMetricFamily samples, for prometheus_client to write."""

    def __init__(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        (name, documentation), (stuck_name, stuck_documentation), *per_worker = WORKER_GAUGES
        workers = GaugeMetricFamily(name, documentation, labels=["region", "state"])
        by_state = Counter(
            (v.region, v.heartbeat.state.value if v.fresh(NOW) else "stale")
            for v in self.snapshot.workers.values())
        for (region, state), count in sorted(by_state.items()):
            workers.add_metric([region, state], float(count))
        stuck = GaugeMetricFamily(stuck_name, stuck_documentation, labels=["region"])
        stuck_by_region = Counter(v.region for v in self.snapshot.workers.values()
                                  if v.heartbeat.engine.stuck_for_s is not None)
        for region in sorted({v.region for v in self.snapshot.workers.values()}):
            stuck.add_metric([region], float(stuck_by_region[region]))
        families = [GaugeMetricFamily(name, documentation, labels=["region", "worker"])
                    for name, documentation in per_worker]
        capacity, load, itl, ttft = families
        for v in self.snapshot.workers.values():
            labels = [v.region, v.worker_id]
            capacity.add_metric(labels, float(v.slots))
            load.add_metric(labels, float(v.reported_load))
            if v.itl_ms is not None:
                itl.add_metric(labels, v.itl_ms / 1000.0)
            if v.ttft_ms is not None:
                ttft.add_metric(labels, v.ttft_ms / 1000.0)
        yield workers
        yield stuck
        yield from families


def collector(*views: WorkerView, worker_metrics: bool = True
              ) -> tuple[FleetCollector, Snapshot]:
    snapshot = Snapshot.build(views, built_at_s=NOW, redis_connected=True,
                              last_redis_ok_at_s=NOW)
    config = GlobalConfig.model_validate({"apiVersion": "globalpool/v1",
                                           "router": {"worker_metrics": worker_metrics},
                                           "regions": {"us-east": {"models": ["m"]}}})
    return FleetCollector(snapshots=SnapshotHolder(snapshot), configs=ConfigHolder(config),
                          drains=DrainHolder(), inflight=InFlight(),
                          clock=lambda: NOW + 5.0), snapshot


async def test_written_as_prometheus_client_writes_them() -> None:
    fleet, snapshot = collector(
        view("a", "us-east", running=3, itl_ms=21.5, ttft_ms=180.0),
        view("b", "eu-west", slots=4_000_000, ttft_ms=0.004),  # a large and a tiny value
        view("c", 'odd "region"\\with\nall three', itl_ms=7.0),  # escaped label value
        view("d", "us-east"),  # neither ITL nor TTFT reported: no sample
        view("e", "us-east", state=LifecycleState.DRAINING),
        view("g", "us-east", state=LifecycleState.DEGRADED, stuck_for_s=15.0),
        view("f", "eu-west", received_at_s=5.0))  # its TTL (2 s) ran out: stale
    reference = CollectorRegistry()
    reference.register(PrometheusClientWay(snapshot))
    assert await fleet.worker_exposition() == generate_latest(reference)


async def test_a_large_fleet_is_written_with_the_event_loop_running_between() -> None:
    fleet, snapshot = collector(*(view(f"w{i}", f"r{i % 3}") for i in range(2_500)))
    text, turns = await with_turns(fleet.worker_exposition())
    assert turns >= 2  # after 1,000 and 2,000 workers (WORKERS_PER_TURN)
    reference = CollectorRegistry()
    reference.register(PrometheusClientWay(snapshot))
    assert text == generate_latest(reference)


async def test_prometheus_reads_them_back() -> None:
    fleet, _ = collector(view("a", "us-east", running=3, itl_ms=21.5),
                         view("c", 'odd "region"\\with\nall three', ttft_ms=90.0))
    samples = {(s.name, s.labels["worker"]): (s.labels["region"], s.value)
               for family in text_string_to_metric_families(
                   (await fleet.worker_exposition()).decode())
               for s in family.samples if "worker" in s.labels}
    assert samples == {
        ("globalpool_worker_capacity_seqs", "a"): ("us-east", 8.0),
        ("globalpool_worker_capacity_seqs", "c"): ('odd "region"\\with\nall three', 8.0),
        ("globalpool_worker_load_seqs", "a"): ("us-east", 4.0),
        ("globalpool_worker_load_seqs", "c"): ('odd "region"\\with\nall three', 1.0),
        ("globalpool_worker_itl_seconds", "a"): ("us-east", 0.0215),
        ("globalpool_worker_ttft_seconds", "c"): ('odd "region"\\with\nall three', 0.09),
    }


async def test_an_empty_fleet_has_the_families_without_samples() -> None:
    fleet, _ = collector()
    text = (await fleet.worker_exposition()).decode()
    assert [f.name for f in text_string_to_metric_families(text)] == [
        name for name, _ in WORKER_GAUGES]
    assert not any(math.isnan(s.value) for f in text_string_to_metric_families(text)
                   for s in f.samples)


async def test_worker_metrics_off_keeps_only_the_count_by_region_and_state() -> None:
    views = [view(f"w{i}", f"r{i % 3}", ttft_ms=90.0, itl_ms=20.0) for i in range(2_500)]
    fleet, _ = collector(*views, worker_metrics=False)
    text = (await fleet.worker_exposition()).decode()
    families = list(text_string_to_metric_families(text))
    assert [f.name for f in families] == ["globalpool_workers",
                                          "globalpool_workers_engine_stuck"]
    assert {s.labels["region"]: s.value for s in families[0].samples} == {
        "r0": 834.0, "r1": 833.0, "r2": 833.0}
    assert {s.labels["region"]: s.value for s in families[1].samples} == {
        "r0": 0.0, "r1": 0.0, "r2": 0.0}  # (0 rather than no sample: alerts see it)
    # the same count as with them on, in a fraction of the text
    on, _ = collector(*views)
    full = (await on.worker_exposition()).decode()
    assert full.startswith(text) and len(text) < len(full) / 100
