"""The router's side of a wedged engine: attempts that wait on a worker whose agent says
its engine runs no step (`engine.stuck_for_s`) are stalled, although the engine counts
them (a long generation, counted as well, is not)."""

from __future__ import annotations

import asyncio

import pytest

from router.core.outcome import Attempt
from router.health import BreakerPolicy, BreakerState, Health
from router.health.stalls import STUCK_SILENCE_S
from router.registry.worker_view import WorkerView
from tests.unit.test_policy import FakeClock, view
from worker.schema import EngineInfo, LifecycleState

POLICY = BreakerPolicy(failures_to_eject=3, base_backoff_s=1.0, max_backoff_s=4.0)


def whole_answer(worker_id: str, started_s: float) -> Attempt:
    return Attempt(worker_id=worker_id, region="us-east", predicted_ttft_ms=50.0,
                   reason="local", started_s=started_s, streamed=False)


def stuck(counted: WorkerView, stuck_for_s: float) -> WorkerView:
    heartbeat = counted.heartbeat.model_copy(update={
        "state": LifecycleState.DEGRADED, "engine": EngineInfo(stuck_for_s=stuck_for_s)})
    return WorkerView(heartbeat, counted.received_at_s, 0)


async def test_requests_an_engine_counts_but_never_steps_are_stalled_once_its_agent_says_so(
) -> None:
    clock = FakeClock(0.0)
    views: dict[str, WorkerView] = {}
    health = Health(POLICY, clock=clock, stall_after_s=3.0, views=lambda: views)
    answered = whole_answer("a", 0.0)  # answered before the engine wedged
    health.dispatched(answered)
    answered.first_byte_s = 0.2
    sent = [whole_answer("a", 0.5 + 0.1 * i) for i in range(3)]
    for attempt in sent:
        health.dispatched(attempt)
    # Its heartbeat counts the three (running): a long generation, as far as it shows.
    views["a"] = view("a", running=3, received_at_s=4.0)
    clock.now = 10.0
    assert health.check_stalls() == []
    assert health.state_of("a") is BreakerState.CLOSED
    # Its agent has seen no engine step for 15 s with them in it.
    views["a"] = stuck(views["a"], 15.0)
    clock.now = 10.5
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(30) as deadline:
            for attempt in sent:
                attempt.first_byte_deadline = deadline
                attempt.elsewhere = lambda: True  # another worker could take each
            assert health.check_stalls() == ["a"]
            await asyncio.sleep(30)
    assert [attempt.abandoned for attempt in sent] == ["worker a stalled"] * 3
    assert health.state_of("a") is BreakerState.OPEN
    assert "agent reports no engine step for 15 s" in health.events[-1].detail


class Connection:
    """An upstream connection as passive health sees it (ReadCounter): its reads."""

    def __init__(self) -> None:
        self.reads = 0
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_a_stuck_report_takes_only_requests_that_have_been_silent_stall_after_s() -> None:
    clock = FakeClock(0.0)
    views = {"a": stuck(view("a", running=2, received_at_s=1.0), 20.0)}
    health = Health(POLICY, clock=clock, stall_after_s=3.0, views=lambda: views)
    moving = whole_answer("a", 0.0)  # its body arrives, a read at a time
    moving.answering = connection = Connection()
    health.dispatched(moving)
    young = whole_answer("a", 1.0)
    health.dispatched(young)
    for tick in range(1, 40):  # 0.1 s apart: the body moves at every check
        clock.now = 0.1 * tick
        connection.reads += 1
        assert health.check_stalls() == [], clock.now
    # Once it stops moving for stall_after_s, the report is believed.
    clock.now = 3.9 + 3.0
    assert health.check_stalls() == ["a"]


def under_way(health: Health, worker_id: str, started_s: float) -> Connection:
    """A stream sent at `started_s` whose first byte came 0.1 s later, relayed since."""
    stream = Attempt(worker_id=worker_id, region="us-east", predicted_ttft_ms=50.0,
                     reason="local", started_s=started_s, streamed=True)
    health.dispatched(stream)
    stream.first_byte_s = started_s + 0.1
    stream.answering = connection = Connection()
    return connection


def test_streams_under_way_on_a_stuck_engine_are_cut_once_silent_to_go_on_elsewhere() -> None:
    clock = FakeClock(0.0)
    views = {"a": view("a", running=2, received_at_s=1.0),
             "b": view("b", running=1, received_at_s=1.0)}
    health = Health(POLICY, clock=clock, stall_after_s=3.0, views=lambda: views)
    on_a, on_b = under_way(health, "a", 0.0), under_way(health, "b", 0.0)
    moving = under_way(health, "a", 0.0)
    clock.now = 0.5
    assert health.check_stalls() == []  # (seen past their first byte: under way)
    # Both silent from here (a wedged engine, a long pause between chunks); only a's
    # agent says its engine is stuck. `moving` still gets chunks (the report is stale).
    views["a"] = stuck(views["a"], 15.0)
    for tick in range(1, 60):
        clock.now = 0.5 + 0.1 * tick
        moving.reads += 1
        health.check_stalls()
        if on_a.closed:
            break
    # Its silence is counted from the first check that knew of the report (0.6 s).
    assert on_a.closed and clock.now == pytest.approx(0.6 + STUCK_SILENCE_S), clock.now
    assert not on_b.closed and not moving.closed
    assert health.events[-1].kind == "streams cut"
    assert health.events[-1].detail == ("1 silent stream(s) cut, to go on elsewhere: its "
                                        "agent reports no step for 15 s")
    clock.now = 30.0
    health.check_stalls()
    assert not on_b.closed  # a long silence with no report is idle_s's to judge
