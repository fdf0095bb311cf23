"""The router's queue for requests that find every worker busy (router.admission.queue),
on literal worker views and an injected clock."""

from __future__ import annotations

import asyncio

import pytest

from router.admission.queue import ENGINE_QUEUE, Backlog, QueueFull, RouterQueue
from router.policy import Decision, NoRoute
from router.registry.inflight import InFlight
from router.registry.worker_view import WorkerView
from worker.schema import Capacity, Heartbeat, LifecycleState, Load

SLOTS = 4


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def view(worker_id: str, running: int = 0) -> WorkerView:
    heartbeat = Heartbeat(
        worker_id=worker_id, region="us-east", endpoint=f"http://127.0.0.1:1/{worker_id}",
        models=("m",), state=LifecycleState.READY, capacity=Capacity(max_num_seqs=SLOTS),
        load=Load(running=running, waiting=0, kv_cache_usage=0.1), seq=1, sent_at_s=0.0, ttl_s=60.0)
    return WorkerView(heartbeat, received_at_s=100.0)


def to(worker: WorkerView) -> Decision:
    return Decision(worker=worker, predicted_ttft_ms=100.0, reason="local", candidates=1)


def setup(running: int = SLOTS + ENGINE_QUEUE) -> tuple[Backlog[str], InFlight, Clock, Decision]:
    inflight, clock = InFlight(), Clock()
    return Backlog(inflight, max_requests=3, clock=clock), inflight, clock, to(view("w", running))


def test_a_worker_has_room_up_to_its_slots_plus_one_waiting() -> None:
    backlog, inflight, _, _ = setup()
    worker = view("w", running=SLOTS)
    assert backlog.has_room(to(worker))  # one may wait in the engine's own queue
    inflight.started("w")
    assert not backlog.has_room(to(worker))
    assert not backlog.must_wait("m", to(view("idle")))


def test_interactive_goes_first_then_arrival_order_and_nothing_overtakes() -> None:
    backlog, inflight, _, full = setup()
    for name, traffic_class in (("b1", "batch"), ("i1", "interactive"), ("b2", "batch"),):
        backlog.push("m", traffic_class, 200.0, lambda: full, name)
    assert backlog.due() == [] and len(backlog) == 3
    # A request that would find room must still queue behind those waiting (no overtaking).
    assert backlog.must_wait("m", to(view("idle")))
    assert not backlog.must_wait("other-model", to(view("idle")))
    # Room for two: the interactive one first, then the batch one that came first.
    room = to(view("w", running=SLOTS + ENGINE_QUEUE - 2))
    for item in backlog._queues["m"]:
        item.pick = lambda: room  # every waiting request now routes there
    assert [item.payload for item, _ in backlog.due()] == ["i1", "b1"]
    assert inflight.own_of("w") == 2  # counted when dispatched: the next head saw them
    assert len(backlog) == 1


def test_tenants_take_turns_within_a_class() -> None:
    inflight, clock = InFlight(), Clock()
    backlog: Backlog[str] = Backlog(inflight, max_requests=100, clock=clock)
    full = to(view("w", running=SLOTS + ENGINE_QUEUE))
    for n in range(5):  # a tenant with five waiting, then two others
        backlog.push("m", "interactive", 200.0, lambda: full, f"noisy{n}", "noisy")
    backlog.push("m", "interactive", 200.0, lambda: full, "quiet0", "quiet")
    backlog.push("m", "batch", 200.0, lambda: full, "batch0", "other")
    backlog.push("m", "interactive", 200.0, lambda: full, "quiet1", "quiet")
    def order() -> list[str]:
        return [item.payload for item in sorted(backlog._queues["m"])]

    # noisy0 and quiet0 share the first turn (arrival decides), then one each; batch last.
    assert order() == ["noisy0", "quiet0", "noisy1", "quiet1", "noisy2", "noisy3", "noisy4",
                       "batch0"]
    room = to(view("w", running=0))
    for item in backlog._queues["m"]:
        item.pick = lambda: room
    assert [item.payload for item, _ in backlog.due()] == [
        "noisy0", "quiet0", "noisy1", "quiet1", "noisy2"]  # room for SLOTS + ENGINE_QUEUE
    # A tenant arriving now starts at the turn being served (3), not at turn 1 ahead of
    # everyone: after noisy3 (turn 4, queued first), before noisy4 (turn 5).
    backlog.push("m", "interactive", 200.0, lambda: full, "late", "late")
    assert order() == ["noisy3", "late", "noisy4", "batch0"]


def test_a_full_queue_refuses_the_tenant_that_holds_most_of_it() -> None:
    inflight, clock = InFlight(), Clock()
    backlog: Backlog[str] = Backlog(inflight, max_requests=4, clock=clock)
    full = to(view("w", running=SLOTS + ENGINE_QUEUE))
    for n in range(4):
        backlog.push("m", "interactive", 200.0, lambda: full, f"noisy{n}", "noisy")
    with pytest.raises(QueueFull):  # its own tenant holds the most: refused
        backlog.push("m", "interactive", 200.0, lambda: full, "noisy4", "noisy")
    backlog.push("m", "interactive", 200.0, lambda: full, "quiet0", "quiet")
    assert [item.payload for item in backlog.evicted] == ["noisy3"]  # its newest
    backlog.evicted.clear()
    backlog.push("m", "interactive", 200.0, lambda: full, "quiet1", "quiet")
    assert [item.payload for item in backlog.evicted] == ["noisy2"]
    with pytest.raises(QueueFull):  # two each: nobody holds more than quiet would
        backlog.push("m", "interactive", 200.0, lambda: full, "quiet2", "quiet")
    assert len(backlog) == 4 and backlog.refused == 4


def test_a_wait_ends_at_its_deadline_and_a_full_queue_refuses() -> None:
    backlog, inflight, clock, full = setup()
    backlog.push("m", "interactive", 101.0, lambda: full, "a")
    backlog.push("m", "interactive", 105.0, lambda: full, "b")
    backlog.push("m", "interactive", 105.0, lambda: full, "c")
    with pytest.raises(QueueFull):
        backlog.push("m", "batch", 105.0, lambda: full, "d")
    assert backlog.refused == 1
    clock.now_s = 101.0
    # `a` goes to its (busy) worker at its deadline; `b` waits on (FIFO: its own deadline).
    assert [(item.payload, d) for item, d in backlog.due()] == [("a", full)]
    assert (backlog.expired, backlog.dispatched, inflight.own_of("w")) == (1, 0, 1)


def test_a_departed_client_is_skipped_and_a_routing_error_is_handed_over() -> None:
    backlog, _, _, full = setup()
    gone = backlog.push("m", "interactive", 200.0, lambda: full, "gone")

    def no_route() -> Decision:
        raise NoRoute("the last worker left")

    backlog.push("m", "interactive", 200.0, no_route, "orphan")
    backlog.leave(gone)
    backlog.leave(gone)  # twice is once
    assert len(backlog) == 1
    ((item, outcome),) = backlog.due()
    assert item.payload == "orphan" and isinstance(outcome, NoRoute)
    assert len(backlog) == 0 and backlog.due() == []


def test_requests_whose_clients_left_do_not_hold_back_a_new_one() -> None:
    backlog, _, _, full = setup()
    first = backlog.push("m", "interactive", 200.0, lambda: full, "first")
    second = backlog.push("m", "batch", 200.0, lambda: full, "second")
    backlog.leave(first)
    assert backlog.must_wait("m", to(view("idle")))  # `second` still waits: no overtaking
    backlog.leave(second)
    assert not backlog.must_wait("m", to(view("idle")))  # only departed ones were left
    assert backlog.due() == [] and len(backlog) == 0


def test_a_client_leaving_after_its_request_left_the_queue_changes_no_count() -> None:
    backlog, _, clock, full = setup()
    item = backlog.push("m", "interactive", 101.0, lambda: full, "late")
    backlog.push("m", "interactive", 200.0, lambda: full, "next")
    clock.now_s = 101.0
    assert [i.payload for i, _ in backlog.due()] == ["late"]
    backlog.leave(item)  # its client went away just as it was sent
    assert len(backlog) == 1


async def test_a_request_goes_at_once_only_while_its_worker_has_room_and_none_waits() -> None:
    inflight, clock = InFlight(), Clock()
    queue = RouterQueue(inflight, max_requests=3, max_wait_s=10.0, clock=clock)
    idle, full = to(view("idle")), to(view("w", running=SLOTS + ENGINE_QUEUE))
    assert queue.goes_now("m", idle) and inflight.own_of("idle") == 1  # counted at once
    assert not queue.goes_now("m", full) and inflight.own_of("w") == 0
    routed = [full]
    waiting = asyncio.create_task(queue.turn(
        full, lambda: routed[0], model="m", traffic_class="interactive",
        arrived_s=clock.now_s, budget_ms=None))
    try:
        await asyncio.sleep(0.05)
        assert len(queue.backlog) == 1
        assert not queue.goes_now("m", idle)  # it does not overtake the one waiting
        routed[0] = idle
        queue.capacity_freed()
        async with asyncio.timeout(2):
            decision, _ = await waiting
        assert decision is idle and inflight.own_of("idle") == 2
    finally:
        waiting.cancel()
        await queue.close()
