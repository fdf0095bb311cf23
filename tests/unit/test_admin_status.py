"""GET /admin/status's document for a large fleet: whole, and made with the event loop
running in between (the status page asks every second)."""

from __future__ import annotations

import json

from router.admin.events import EventLog
from router.admin.status import WORKERS_PER_TURN, AdminContext, status_json
from router.config import GlobalConfig
from router.config_reload import ConfigHolder
from router.registry.drains import DrainHolder
from router.registry.inflight import InFlight
from router.registry.snapshot import Snapshot, SnapshotHolder
from router.registry.worker_view import WorkerView
from router.telemetry.window import TrafficWindow
from tests.unit.loop_turns import with_turns
from worker.schema import Capacity, Heartbeat, LifecycleState, Load

NOW = 50.0


def view(worker_id: str, region: str, running: int) -> WorkerView:
    return WorkerView(Heartbeat(
        worker_id=worker_id, region=region, endpoint="http://127.0.0.1:1", models=("m",),
        state=LifecycleState.READY, capacity=Capacity(max_num_seqs=4),
        load=Load(running=running, waiting=0, kv_cache_usage=0.5),
        seq=1, sent_at_s=1.0, ttl_s=2.0), received_at_s=NOW)


def context(views: list[WorkerView]) -> AdminContext:
    config = GlobalConfig.model_validate({
        "apiVersion": "globalpool/v1",
        "regions": {"a": {"models": ["m"], "rtt_ms": {"b": 10}}, "b": {"models": ["m"]}}})
    snapshot = Snapshot.build(views, built_at_s=NOW, redis_connected=True,
                              last_redis_ok_at_s=NOW)
    return AdminContext(region="a", configs=ConfigHolder(config),
                        snapshots=SnapshotHolder(snapshot), drain_holder=DrainHolder(),
                        inflight=InFlight(), window=TrafficWindow(), events=EventLog(),
                        clock=lambda: NOW + 0.5)


async def test_a_large_fleet_is_described_whole_with_the_loop_running_between() -> None:
    views = [view(f"w{i:04d}", "ab"[i % 2], running=i % 5) for i in range(2_500)]
    document, turns = await with_turns(status_json(context(views)))
    status = json.loads(document)
    # Described WORKERS_PER_TURN at a time (a turn between parts), encoded so too (a turn
    # before each part).
    parts = -(-len(views) // WORKERS_PER_TURN)
    assert parts >= 3 and turns >= 2 * parts - 1
    assert [w["id"] for w in status["workers"]] == sorted(
        (v.worker_id for v in views), key=lambda w: ("ab"[int(w[1:]) % 2], w))
    assert {w["status"] for w in status["workers"]} == {"ready"}
    regions = {r["name"]: r for r in status["regions"]}
    assert regions["a"]["workers"] == {"ready": 1_250} == regions["b"]["workers"]
    assert regions["a"]["capacity_seqs"] == 4 * 1_250
    assert regions["a"]["load_seqs"] == sum(i % 5 for i in range(0, 2_500, 2))
    assert status["redis"]["connected"] is True and status["router"]["region"] == "a"


async def test_an_empty_fleet_has_an_empty_list() -> None:
    status = json.loads(await status_json(context([])))
    assert status["workers"] == []
    assert [r["health"] for r in status["regions"]] == ["down", "down"]
