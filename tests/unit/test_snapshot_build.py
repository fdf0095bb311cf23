"""Snapshot.build_in_steps: the same snapshot as Snapshot.build, with pauses a large
fleet's collector lets requests run in."""

from __future__ import annotations

from typing import Any

import pytest

from router.registry.snapshot import VIEWS_PER_STEP, Snapshot
from router.registry.worker_view import WorkerView
from worker.schema import Capacity, Heartbeat, LifecycleState, Load

STATE: dict[str, Any] = {"built_at_s": 5.0, "redis_connected": True, "last_redis_ok_at_s": 5.0}


def view(i: int) -> WorkerView:
    models = ("m", "n") if i % 4 else ("m",)  # two sets of models: several groups a region
    return WorkerView(Heartbeat(
        worker_id=f"w{i:05d}", region=f"r{i % 3}", endpoint="http://127.0.0.1:1",
        models=models, state=LifecycleState.READY, capacity=Capacity(max_num_seqs=8),
        load=Load(running=i % 7, waiting=i % 2, kv_cache_usage=None),
        seq=1, sent_at_s=1.0, ttl_s=2.0), received_at_s=5.0)


def described(snapshot: Snapshot) -> tuple[object, ...]:
    return (list(snapshot.workers), {m: [v.worker_id for v in vs]
                                     for m, vs in snapshot.by_model.items()},
            {m: [(r.region, [v.worker_id for v in r.views], r.min_prefill_ms_per_token,
                  r.min_engine_ms) for r in rankings]
             for m, rankings in snapshot.ranked.items()},
            snapshot.built_at_s, snapshot.redis_connected, snapshot.last_redis_ok_at_s)


@pytest.mark.parametrize("workers", [0, 10, 6_000])
def test_the_steps_make_the_snapshot_build_makes(workers: int) -> None:
    views = [view(i) for i in range(workers)]
    steps = Snapshot.build_in_steps(views, **STATE)
    pauses = 0
    while True:
        try:
            next(steps)
        except StopIteration as done:
            stepped = done.value
            break
        pauses += 1
    assert described(stepped) == described(Snapshot.build(views, **STATE))
    if workers > 2 * VIEWS_PER_STEP:
        # Grouping pauses every VIEWS_PER_STEP views, ranking about as often.
        assert pauses >= 2 * (workers // VIEWS_PER_STEP)
    if workers:
        assert set(stepped.ranked) == ({"m", "n"} if workers >= 48 else set())


def test_the_views_are_read_before_the_first_pause() -> None:
    views = [view(i) for i in range(100)]
    steps = Snapshot.build_in_steps(views, **STATE)
    next(steps)
    views.clear()  # as the collector's table may change once it has let others run
    with pytest.raises(StopIteration) as done:
        while True:
            next(steps)
    assert len(done.value.value.workers) == 100


def test_ready_terms_are_the_ready_workers_scoring_terms_read_once() -> None:
    views = [view(i) for i in range(6)]
    draining = WorkerView(Heartbeat(
        worker_id="gone", region="r0", endpoint="http://127.0.0.1:1", models=("m",),
        state=LifecycleState.DRAINING, capacity=Capacity(max_num_seqs=8),
        load=Load(running=2, waiting=0, kv_cache_usage=None), seq=1,
        sent_at_s=1.0, ttl_s=2.0), received_at_s=5.0, inflight_at_receipt=1)
    snapshot = Snapshot.build([*views, draining], **STATE)
    rows = snapshot.ready_terms("m")
    assert rows is snapshot.ready_terms("m")  # built once
    assert [row[1] for row in rows] == [v.worker_id for v in snapshot.by_model["m"] if v.ready]
    for row in rows:
        v = row[0]
        assert row[1:] == (v.worker_id, v.region, v.expires_at_s, v.engine_ms,
                           v.prefill_ms_per_token,
                           v.running + v.waiting - v.inflight_at_receipt + 1 - v.slots,
                           v.queue_ms_per_request)
    assert snapshot.ready_terms("unknown") == ()
    assert "unknown" not in snapshot._terms  # a client's made-up model costs no memory
    assert Snapshot.build(views, **STATE).ready_terms("m") is not rows  # per snapshot
