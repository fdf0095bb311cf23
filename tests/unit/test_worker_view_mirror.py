"""A view made again in another process (WorkerView.load_items / mirrored) and refreshed
in place there (WorkerView.refresh): router.registry.mirror's building blocks."""

from __future__ import annotations

import marshal

from router.registry.worker_view import WorkerView, changes_since, take_loads
from worker.schema import Capacity, Heartbeat, LifecycleState, Load, Performance

TERMS = ("worker_id", "seq", "sent_at_s", "running", "waiting", "kv_cache_usage", "ttft_ms",
         "itl_ms", "e2e_ms", "prefill_tokens_per_s", "decode_tokens_per_s", "received_at_s",
         "expires_at_s", "reported_load", "slots", "queue_base", "queue_ms_per_request",
         "kv_pressure_ms", "prefill_ms_per_token", "first_step_ms", "engine_ms",
         "utilisation", "inflight_at_receipt", "ready", "served", "cache_tokens")


def heartbeat(running: int = 3, kv: float = 0.95) -> Heartbeat:
    return Heartbeat(
        worker_id="w", region="r", endpoint="http://127.0.0.1:1", models=("m",),
        state=LifecycleState.READY, capacity=Capacity(max_num_seqs=8),
        load=Load(running=running, waiting=2, kv_cache_usage=kv),
        performance=Performance(ttft_ms=40.0, itl_ms=9.0, e2e_ms=700.0,
                                prefill_tokens_per_s=5000.0),
        seq=4, sent_at_s=1000.0, ttl_s=2.0)


def terms(view: WorkerView) -> dict[str, object]:
    return {name: getattr(view, name) for name in TERMS}


def test_a_mirrored_view_has_every_term_of_the_one_it_mirrors() -> None:
    original = WorkerView(heartbeat(), received_at_s=50.0, inflight_at_receipt=1,
                          next_read_s=3.0)  # fresh for longer than its TTL
    items = marshal.loads(marshal.dumps(original.load_items()))  # as the feed sends it
    base = WorkerView(heartbeat(running=0, kv=0.0), received_at_s=0.0)
    copy = base.mirrored(items, inflight_at_receipt=1)
    assert terms(copy) == terms(original)
    assert copy.expires_at_s == 53.0  # the first process's freshness, not recomputed


def test_this_process_open_requests_go_into_the_mirrored_view() -> None:
    original = WorkerView(heartbeat(), received_at_s=50.0, inflight_at_receipt=0)
    copy = original.mirrored(original.load_items(), inflight_at_receipt=2)
    assert copy.queue_base == original.queue_base - 2


def test_refresh_takes_a_report_with_the_same_figures_in_place() -> None:
    view = WorkerView(heartbeat(), received_at_s=50.0, inflight_at_receipt=0)
    newer = WorkerView(heartbeat().model_copy(update={"seq": 9, "sent_at_s": 1001.0}),
                       received_at_s=51.0, inflight_at_receipt=0, next_read_s=4.0)
    before = terms(view)
    assert view.refresh(newer.load_items(), inflight_at_receipt=1)
    after = terms(view)
    moved = {name for name in TERMS if before[name] != after[name]}
    assert moved == {"seq", "sent_at_s", "received_at_s", "expires_at_s",
                     "inflight_at_receipt", "queue_base"}
    assert (view.seq, view.received_at_s, view.expires_at_s) == (9, 51.0, 55.0)
    assert view.queue_base == newer.queue_base - 1


def test_refresh_leaves_a_view_whose_figures_changed_alone() -> None:
    view = WorkerView(heartbeat(), received_at_s=50.0)
    before = terms(view)
    for changed in (heartbeat(running=4), heartbeat(kv=0.5)):
        assert not view.refresh(WorkerView(changed, 51.0).load_items(), 0)
        assert terms(view) == before


def test_changes_since_sorts_a_table_into_what_followers_must_be_sent() -> None:
    """The feed's scan (router.registry.feed): a view the followers have is skipped, a new
    load of a heartbeat they have goes as load figures, a new heartbeat whole; the
    workers left in `shipped` are those that left."""
    kept = WorkerView(heartbeat(), received_at_s=1.0)
    loaded = WorkerView(heartbeat(), received_at_s=1.0)
    newer_load = loaded.mirrored((*loaded.load_items()[:3], 7, *loaded.load_items()[4:]), 0)
    replaced = WorkerView(heartbeat(), received_at_s=1.0)
    new_heartbeat = WorkerView(heartbeat(running=5), received_at_s=2.0)
    first_seen = WorkerView(heartbeat(), received_at_s=2.0)
    left = WorkerView(heartbeat(), received_at_s=1.0)
    shipped = {"kept": kept, "loaded": loaded, "replaced": replaced, "left": left}
    table = [("kept", kept), ("loaded", newer_load), ("replaced", new_heartbeat),
             ("first", first_seen)]
    current: dict[str, WorkerView] = {}
    heartbeats: list[WorkerView] = []
    loads: list[tuple[object, ...]] = []
    changes_since(table, shipped, current, heartbeats, loads)
    assert current == dict(table)
    assert loads == [newer_load.load_items()] and loads[0][3] == 7
    assert heartbeats == [new_heartbeat, first_seen]
    assert list(shipped) == ["left"]


def test_take_loads_refreshes_equal_figures_and_replaces_the_rest() -> None:
    idle = WorkerView(heartbeat(), received_at_s=1.0)
    busy = WorkerView(heartbeat(), received_at_s=1.0)
    views = {"idle": idle, "busy": busy}
    again = ("idle", 9, 1001.0, *idle.load_items()[3:])
    busier = ("busy", *busy.load_items()[1:3], 6, *busy.load_items()[4:])
    gone = ("gone", *idle.load_items()[1:])
    replaced, refreshed = take_loads(views, [again, busier, gone], lambda _worker: 2)
    assert (replaced, refreshed) == (True, True)
    assert views["idle"] is idle and idle.seq == 9 and idle.inflight_at_receipt == 2
    assert views["busy"] is not busy and views["busy"].running == 6
    assert views["busy"].inflight_at_receipt == 2 and "gone" not in views
    assert take_loads(views, [], lambda _worker: 0) == (False, False)
