"""The breaker's state machine, the health filter and the retry budget, with an injected clock."""

from __future__ import annotations

import asyncio
import functools
import time
from collections import Counter

import pytest

from router.core.outcome import Attempt, Failure, Prediction
from router.health import Breaker, BreakerPolicy, BreakerState, Health, RetryBudget
from router.health.loop_lag import LoopLag
from router.health.penalties import PENALTY_FLOOR_MS, PROBE_HOLD_S, RegionPenalties
from router.health.stalls import ASKS_PER_CHECK
from router.registry.worker_view import WorkerView
from tests.unit.test_policy import FakeClock, view

FLOOR = PENALTY_FLOOR_MS
POLICY = BreakerPolicy(failures_to_eject=3, base_backoff_s=1.0, max_backoff_s=4.0)


def test_breaker_ejects_after_consecutive_failures_and_probes_half_open() -> None:
    breaker = Breaker(POLICY)
    assert not breaker.failed(0.0, severe=False)
    assert not breaker.failed(0.0, severe=False)
    assert breaker.succeeded(0.0) is False  # a success in between resets the count
    for _ in range(2):
        assert not breaker.failed(1.0, severe=False)
    assert breaker.failed(1.0, severe=False)
    assert breaker.state is BreakerState.OPEN
    assert not breaker.admits(1.5)
    assert breaker.admits(2.0)  # backoff over: half-open, one probe allowed
    assert breaker.state is BreakerState.HALF_OPEN  # type: ignore[comparison-overlap]
    breaker.dispatched()
    assert not breaker.admits(2.0)  # the probe is out; everyone else waits
    assert breaker.succeeded(2.0) is True
    assert breaker.state is BreakerState.CLOSED and breaker.admits(2.0)


def test_a_flapping_worker_stays_out_longer_after_every_comeback() -> None:
    breaker = Breaker(BreakerPolicy(base_backoff_s=1.0, max_backoff_s=30.0))
    now, backoffs = 0.0, []
    for _ in range(4):
        assert breaker.failed(now, severe=True)  # killed again soon after its comeback
        backoffs.append(breaker.open_until_s - now)
        now = breaker.open_until_s
        assert breaker.admits(now)
        breaker.dispatched()
        assert breaker.succeeded(now) is True  # readmitted by its probe...
        now += 2.0  # ...and killed 2 s later
    assert backoffs == [1.0, 4.0, 16.0, 30.0]
    assert not breaker.forgettable
    assert breaker.succeeded(now + 31.0) is False  # a stretch of success: forgotten
    assert breaker.forgettable
    assert breaker.failed(now + 32.0, severe=True)
    assert breaker.open_until_s == now + 33.0


def test_going_down_again_while_ejected_extends_the_ejection() -> None:
    breaker = Breaker(POLICY)  # base 1 s, cap 4 s
    assert breaker.failed(0.0, severe=True)
    assert not breaker.failed(0.2, severe=True)  # another request of the same crash
    assert breaker.open_until_s == 1.0
    assert breaker.failed(0.5, severe=True, went_down=True)  # its heartbeat: down again
    assert breaker.open_until_s == 2.5


def test_failed_probe_doubles_the_backoff_up_to_the_cap() -> None:
    breaker = Breaker(POLICY)
    assert breaker.failed(0.0, severe=True)  # connection refused: at once
    assert breaker.open_until_s == 1.0
    ends = []
    now = 1.0
    for _ in range(4):
        assert breaker.admits(now)
        breaker.dispatched()
        assert breaker.failed(now, severe=False)  # a failed probe re-ejects at once
        ends.append(breaker.open_until_s - now)
        now = breaker.open_until_s
    assert ends == [2.0, 4.0, 4.0, 4.0]


def attempt(worker_id: str, failure: Failure | None, region: str = "us-east", *,
            ttfb_s: float | None = 0.05, predicted_ms: float = 50.0,
            retry_after_s: float | None = None) -> Attempt:
    result = Attempt(worker_id=worker_id, region=region, predicted_ttft_ms=predicted_ms,
                     reason="local", started_s=0.0, failure=failure, streamed=True,
                     retry_after_s=retry_after_s)
    if failure is None and ttfb_s is not None:
        result.first_byte_s = ttfb_s
    return result


def test_health_filter_ejects_refused_workers_and_fails_open() -> None:
    clock = FakeClock(10.0)
    health = Health(POLICY, clock=clock)
    views = [view("a"), view("b"), view("c", "eu-west")]
    health.attempt_finished(attempt("a", Failure.CONNECT))
    assert [v.worker_id for v in health.filter(views, 10.0)] == ["b", "c"]
    assert health.ejections_total == 1
    assert health.events[-1].kind == "ejected"
    for worker_id in ("b", "c"):
        health.attempt_finished(attempt(worker_id, Failure.RESET))
    # Everything is ejected: the filter fails open rather than leave nothing to try.
    assert [v.worker_id for v in health.filter(views, 10.0)] == ["a", "b", "c"]


def test_busy_is_not_a_failure_but_is_honoured() -> None:
    clock = FakeClock(10.0)
    health = Health(POLICY, clock=clock)
    views = [view("a"), view("b")]
    health.attempt_finished(attempt("a", Failure.BUSY, retry_after_s=2.0))
    assert [v.worker_id for v in health.filter(views, 11.0)] == ["b"]
    assert [v.worker_id for v in health.filter(views, 12.5)] == ["a", "b"]
    assert health.ejections_total == 0 and health.state_of("a") is BreakerState.CLOSED


def test_a_region_with_most_workers_ejected_is_ejected() -> None:
    health = Health(POLICY, clock=FakeClock(0.0))
    views = [view("us-1"), view("us-2"), view("us-3"), view("eu-1", "eu-west")]
    for worker_id in ("us-1", "us-2"):
        health.attempt_finished(attempt(worker_id, Failure.CONNECT))
    assert [v.worker_id for v in health.filter(views, 0.1)] == ["eu-1"]


def test_slow_region_learns_a_penalty_that_decays() -> None:
    clock = FakeClock(0.0)
    health = Health(POLICY, clock=clock, latency_half_life_s=10.0)
    for _ in range(20):
        # Both regions answer 20 ms later than predicted (a constant miss), eu-west 500 more.
        health.attempt_finished(attempt("us-1", None, "us-east", ttfb_s=0.070,
                                        predicted_ms=50.0))
        health.attempt_finished(attempt("eu-1", None, "eu-west", ttfb_s=0.570,
                                        predicted_ms=50.0))
    # Compared with the other region's miss, less a noise floor.
    assert health.region_penalty_ms("eu-west", 0.0) == pytest.approx(500.0 - FLOOR, rel=0.05)
    assert health.region_penalty_ms("eu-west", 10.0) == pytest.approx(
        (520.0 - 20.0) / 2 - FLOOR, rel=0.05)
    assert health.region_penalty_ms("us-east", 0.0) == 0.0
    assert health.region_penalty_ms("ap-south", 0.0) == 0.0
    # All of them at once, as /metrics and /admin/status show them: the regions sampled.
    assert health.region_penalties(10.0) == {
        "eu-west": pytest.approx((520.0 - 20.0) / 2 - FLOOR, rel=0.05), "us-east": 0.0}
    assert Health(POLICY, clock=FakeClock(0.0)).region_penalties(0.0) == {}


def test_a_slow_region_that_carries_all_the_traffic_is_penalised() -> None:
    health = Health(POLICY, clock=FakeClock(0.0))
    for _ in range(20):
        health.attempt_finished(attempt("us-1", None, "us-east", ttfb_s=0.350,
                                        predicted_ms=50.0))
    # No other region has samples: judged against the prediction itself.
    assert health.region_penalty_ms("us-east", 0.0) == pytest.approx(300.0 - FLOOR, rel=0.05)
    quiet = Health(POLICY, clock=FakeClock(0.0))
    for _ in range(20):
        quiet.attempt_finished(attempt("us-1", None, "us-east", ttfb_s=0.065,
                                       predicted_ms=50.0))
    assert quiet.region_penalty_ms("us-east", 0.0) == 0.0  # a small miss is noise


def test_one_slow_worker_does_not_penalise_its_region() -> None:
    """A region's penalty needs misses on several of its workers: one slow worker is the
    worker's (its queue terms and breaker deal with it), not its region's path."""
    views = {"us-1": view("us-1"), "us-2": view("us-2"), "eu-1": view("eu-1", "eu-west")}
    health = Health(POLICY, clock=FakeClock(0.0), views=lambda: views)
    for _ in range(20):
        health.attempt_finished(attempt("us-1", None, "us-east", ttfb_s=0.450,
                                        predicted_ms=50.0))
    assert health.region_penalty_ms("us-east", 0.0) == 0.0
    for _ in range(20):  # the second worker too: the region's path it is
        health.attempt_finished(attempt("us-2", None, "us-east", ttfb_s=0.350,
                                        predicted_ms=50.0))
    # The least of its workers' misses, less the noise floor.
    assert health.region_penalty_ms("us-east", 0.0) == pytest.approx(300.0 - FLOOR, rel=0.05)


def test_the_routers_own_lag_is_kept_out_of_what_is_learnt() -> None:
    """A CPU hog beside the router delays its reading of first bytes: the time its loop
    could not run while an attempt waited is taken off that attempt's TTFB, and an
    attempt whose wait was mostly that teaches nothing."""

    def teach(health: Health, lost_s: float, at_s: float = 0.45) -> None:
        for index in range(20):
            sent = attempt("us-1", None, "us-east", ttfb_s=0.450, predicted_ms=50.0)
            sent.started_s, sent.first_byte_s = 10.0 * index, 10.0 * index + 0.450
            if lost_s:
                health.loop_lag.record(lost_s, 10.0 * index + at_s)
            health.attempt_finished(sent)

    partly = Health(POLICY, clock=FakeClock(0.0))
    teach(partly, 0.2)  # 450 ms, 200 of them here: 200 ms beyond the prediction
    assert partly.region_penalty_ms("us-east", 0.0) == pytest.approx(200.0 - FLOOR, rel=0.05)
    assert partly.penalty_samples_skipped == 0
    mostly = Health(POLICY, clock=FakeClock(0.0))
    teach(mostly, 0.3)  # more than half the wait
    assert mostly.region_penalty_ms("us-east", 0.0) == 0.0
    assert mostly.penalty_samples_skipped == 20
    # Lost long before the first byte (the worker was busy meanwhile anyway) or after it:
    # not the attempt's wait; the path's 400 ms are learnt.
    after = Health(POLICY, clock=FakeClock(0.0))
    teach(after, 5.0, at_s=0.9)
    teach(after, 0.1, at_s=0.1)
    assert after.region_penalty_ms("us-east", 0.0) == pytest.approx(400.0 - FLOOR, rel=0.05)


def test_loop_lag_around_a_moment() -> None:
    lag = LoopLag()
    assert lag.around(5.0) == 0.0
    for moment in (1.0, 1.01, 2.0):
        lag.record(0.003, moment)  # a busy loop: every tick a little late
    lag.record(0.2, 3.0)  # a stall
    # The longest wait seen within a tick of the moment, not the sum of the waits.
    assert (lag.around(1.005), lag.around(2.999), lag.around(2.5)) == (0.003, 0.2, 0.0)
    for index in range(5000):  # bounded: the oldest half goes
        lag.record(0.001, 4.0 + index)
    assert lag.around(1.0) == 0.0 and lag.around(4.0 + 4999) == 0.001
    assert lag.total_s == pytest.approx(0.009 + 0.2 + 5.0)


def test_an_engine_slower_than_predicted_is_the_engines_not_the_paths() -> None:
    """What the worker itself reports its requests waited for a first token (its
    heartbeat's TTFT) is the engine's part, not the path's."""
    slow_engine = {"us-1": view("us-1", ttft_ms=400.0)}
    health = Health(POLICY, clock=FakeClock(0.0), views=lambda: slow_engine)
    parts = Prediction(rtt_ms=2.0, penalty_ms=0.0, queue_ms=0.0, prefill_ms=20.0,
                       first_step_ms=28.0)
    for _ in range(20):
        sent = attempt("us-1", None, "us-east", ttfb_s=0.420, predicted_ms=50.0)
        sent.prediction = parts
        health.attempt_finished(sent)
    assert health.region_penalty_ms("us-east", 0.0) == 0.0
    slow_path = Health(POLICY, clock=FakeClock(0.0),
                       views=lambda: {"us-1": view("us-1", ttft_ms=48.0)})
    for _ in range(20):
        sent = attempt("us-1", None, "us-east", ttfb_s=0.420, predicted_ms=50.0)
        sent.prediction = parts
        slow_path.attempt_finished(sent)
    assert slow_path.region_penalty_ms("us-east", 0.0) == pytest.approx(370.0 - FLOOR,
                                                                         rel=0.05)


async def test_the_loop_lag_watch_adds_up_lost_time() -> None:
    health = Health(POLICY)
    started_s = time.monotonic()
    task = asyncio.create_task(health.loop_lag.watch(tick_s=0.01))
    await asyncio.sleep(0.05)
    time.sleep(0.1)  # noqa: ASYNC251 (the loop cannot run: a hog, or a blocking call)
    await asyncio.sleep(0.05)
    task.cancel()
    # At least the blocked 100 ms (less a tick), never more than the time that passed.
    assert 0.08 <= health.loop_lag.total_s <= time.monotonic() - started_s


def test_a_degraded_heartbeat_ejects_through_the_breaker() -> None:
    clock = FakeClock(10.0)
    health = Health(POLICY, clock=clock)
    views = [view("a"), view("b")]
    health.reported_down("a", "us-east", "degraded")
    assert [v.worker_id for v in health.filter(views, 10.5)] == ["b"]
    assert health.events[-1].kind == "ejected" and "heartbeat" in health.events[-1].detail
    assert [v.worker_id for v in health.filter(views, 11.0)] == ["a", "b"]  # half-open probe


def test_retry_budget_caps_retries_at_a_share_of_requests() -> None:
    clock = FakeClock(0.0)
    budget = RetryBudget(0.2, min_per_s=0.0, cap=10.0, clock=clock)
    allowed = 0
    for _ in range(100):
        budget.request_arrived()
        allowed += budget.try_spend()
    assert 20 <= allowed <= 22  # 20% of 100, plus the initial allowance of 2
    assert budget.denied == 100 - allowed
    floor = RetryBudget(0.0, min_per_s=5.0, cap=10.0, clock=clock)
    spent = sum(floor.try_spend() for _ in range(10))
    clock.now += 1.0
    assert floor.try_spend() and spent == 2


def streaming(worker_id: str, region: str, started_s: float) -> Attempt:
    return Attempt(worker_id=worker_id, region=region, predicted_ttft_ms=50.0, reason="local",
                   started_s=started_s, streamed=True)


async def test_a_worker_that_answers_nobody_is_stalled_and_its_waits_abandoned() -> None:
    clock = FakeClock(0.0)
    health = Health(POLICY, clock=clock, stall_after_s=3.0, stall_factor=10.0)
    stuck, other = streaming("a", "us-east", 0.0), streaming("b", "eu-west", 0.0)
    health.dispatched(stuck)
    health.dispatched(other)
    other.first_byte_s = 0.5  # the other region answers
    clock.now = 2.0
    assert health.check_stalls() == []  # waiting, but not yet stall_after_s
    clock.now = 3.5
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(30) as deadline:
            stuck.first_byte_deadline = deadline  # as forward_stream sets it
            assert health.check_stalls() == ["a"]
            await asyncio.sleep(30)  # abandoned: the wait ends now, not in 30 s
    assert stuck.abandoned == "worker a stalled"
    assert health.state_of("a") is BreakerState.OPEN
    assert "stalled" in health.events[-1].detail
    # Once its backoff has run out it shows as half-open (its next request is the probe),
    # even before a request has asked the breaker (no traffic for it meanwhile).
    clock.now = 3.5 + 60.0
    assert health.state_of("a") is BreakerState.HALF_OPEN


async def test_a_stalled_workers_attempt_with_nowhere_else_to_go_keeps_waiting() -> None:
    # The worker's heartbeat counts none of three requests (a hung engine, or one starved
    # of CPU whose counts are late): each is abandoned only once its request could go to
    # another worker, or once it has waited stall_factor x stall_after_s (30 s).
    clock = FakeClock(0.0)
    views = {"a": view("a", running=0, received_at_s=3.5)}
    health = Health(POLICY, clock=clock, stall_after_s=3.0, stall_factor=10.0,
                    views=lambda: views)
    room = {"retry": False, "last": False}
    retry, last, unasked = (streaming("a", "us-east", 0.0) for _ in range(3))
    retry.elsewhere = lambda: room["retry"]
    last.elsewhere = lambda: room["last"]
    async with asyncio.timeout(60) as deadline:  # noqa: ASYNC100 (what abandon reschedules)
        for attempt in (retry, last, unasked):
            attempt.first_byte_deadline = deadline
            health.dispatched(attempt)
        clock.now = 3.6
        assert health.check_stalls() == ["a"]
        assert (retry.abandoned, last.abandoned) == (None, None)
        assert unasked.abandoned == "worker a stalled"  # (no `elsewhere`: as before)
        assert health.state_of("a") is BreakerState.OPEN
        said = [e.detail for e in health.events if e.kind == "ejected"]
        assert len(said) == 1 and said[0].endswith(
            "2 kept waiting there: no other worker can take them"), said
        clock.now = 3.85  # found again at the next check: not ejected, nor said, again
        assert health.check_stalls() == ["a"]
        assert len([e for e in health.events if e.kind == "ejected"]) == 1
        clock.now = 4.65  # its 1 s backoff has run out, and it is still stalled: out again
        assert health.check_stalls() == ["a"]
        said = [e.detail for e in health.events if e.kind == "ejected"]
        assert len(said) == 2 and "back in 2.0 s" in said[-1], said
        assert health.state_of("a") is BreakerState.OPEN
        room["retry"] = True  # another worker can take one of them now
        clock.now = 4.9
        health.check_stalls()
        assert retry.abandoned == "worker a stalled" and last.abandoned is None
        assert "1 kept waiting" in health.events[-1].detail
        clock.now = 29.9
        health.check_stalls()
        assert last.abandoned is None
        clock.now = 30.1  # past hope: an error now, not at timeouts.total_s (900 s)
        health.check_stalls()
        assert last.abandoned == "worker a stalled"
    # A kept attempt that is answered after all readmits its worker.
    late = streaming("a", "us-east", 40.0)
    late.elsewhere = lambda: False
    health.dispatched(late)
    clock.now = 43.6
    views["a"] = view("a", running=0, received_at_s=43.5)
    assert health.check_stalls() == ["a"] and late.abandoned is None
    late.first_byte_s = late.finished_s = clock.now = 45.0
    late.status = 200
    health.attempt_finished(late)
    assert health.state_of("a") is BreakerState.CLOSED


def test_kept_attempts_are_asked_in_turn_a_bounded_number_a_check() -> None:
    # 40 requests wait on a stalled worker with nowhere else to go: each check asks at
    # most ASKS_PER_CHECK of them (each ask is a routing decision), every one in turn.
    clock = FakeClock(0.0)
    health = Health(POLICY, clock=clock, stall_after_s=3.0, stall_factor=10.0,
                    views=lambda: {"a": view("a", running=0, received_at_s=3.5)})
    asked: Counter[int] = Counter()

    def nowhere(number: int) -> bool:
        asked[number] += 1
        return False

    for number in range(40):
        waiting = streaming("a", "us-east", 0.0)
        waiting.elsewhere = functools.partial(nowhere, number)
        health.dispatched(waiting)
    clock.now = 3.6
    health.check_stalls()
    assert sum(asked.values()) == ASKS_PER_CHECK
    clock.now = 3.85
    health.check_stalls()
    assert sum(asked.values()) == 2 * ASKS_PER_CHECK and set(asked) == set(range(40))


def test_no_stall_when_nobody_answers_or_the_worker_answered_since() -> None:
    clock = FakeClock(0.0)
    health = Health(POLICY, clock=clock, stall_after_s=3.0)
    alone = streaming("a", "us-east", 0.0)
    health.dispatched(alone)
    clock.now = 10.0
    assert health.check_stalls() == []  # no worker answered anything: not this one's fault
    later = streaming("a", "us-east", 1.0)
    health.dispatched(later)
    later.first_byte_s = 1.2  # it answered a younger request: busy, not stalled
    other = streaming("b", "eu-west", 0.0)
    health.dispatched(other)
    other.first_byte_s = 9.0
    assert health.check_stalls() == []
    assert health.state_of("a") is BreakerState.CLOSED


def test_a_worker_whose_own_heartbeat_misses_my_requests_is_stalled() -> None:
    # All traffic goes to one partitioned region: no other worker answers, but the
    # worker's heartbeat (its agent probes it directly) counts none of the requests sent
    # there: they never arrived.
    clock = FakeClock(0.0)
    views: dict[str, WorkerView] = {}
    health = Health(POLICY, clock=clock, stall_after_s=3.0, views=lambda: views)
    sent = [streaming("a", "us-east", 0.1 * i) for i in range(3)]
    for attempt in sent:
        health.dispatched(attempt)
    clock.now = 3.5
    views["a"] = view("a", running=0, received_at_s=2.9)
    # Received less than stall_after_s after the requests: it may have been probed before
    # they reached the engine's scheduler (a starved API server takes seconds).
    assert health.check_stalls() == []
    clock.now = 3.6
    views["a"] = view("a", running=0, received_at_s=3.5)
    assert health.check_stalls() == ["a"]
    assert "heartbeat counts 0 sequences of the 3" in health.events[-1].detail
    busy = Health(POLICY, clock=clock, stall_after_s=3.0,
                  views=lambda: {"a": view("a", running=8, waiting=4, received_at_s=3.5)})
    for attempt in [streaming("a", "us-east", 0.1 * i) for i in range(3)]:
        busy.dispatched(attempt)
    assert busy.check_stalls() == []  # a long queue there, not a partition


def test_prune_forgets_departed_workers_and_spent_marks_but_nothing_that_matters() -> None:
    clock = FakeClock(0.0)
    views: dict[str, WorkerView] = {"here": view("here"), "busy": view("busy")}
    health = Health(POLICY, clock=clock, views=lambda: views)
    for worker_id in ("gone", "here"):  # both ejected (a refused connection)
        health.attempt_finished(attempt(worker_id, Failure.CONNECT))
    health.attempt_finished(attempt("busy", Failure.BUSY, retry_after_s=1.0))
    clock.now = 10.0  # every backoff and busy mark has run out
    assert health.state_of("gone") is BreakerState.HALF_OPEN
    health.prune()
    assert health.state_of("gone") is BreakerState.CLOSED  # forgotten: it left the view
    assert health.state_of("here") is BreakerState.HALF_OPEN  # still in the fleet: kept
    assert not health.quiet
    views.pop("here")  # it leaves too: nothing is left to remember
    health.prune()
    assert health.quiet


def test_a_probe_whose_client_left_readmits_nobody_and_frees_the_probe() -> None:
    clock = FakeClock(0.0)
    health = Health(POLICY, clock=clock)
    health.attempt_finished(attempt("a", Failure.CONNECT))  # ejected for 1 s
    clock.now = 1.5
    assert health.state_of("a") is BreakerState.HALF_OPEN
    assert [v.worker_id for v in health.filter([view("a")], 1.5)] == ["a"]  # the probe
    probe = Attempt(worker_id="a", region="us-east", predicted_ttft_ms=50.0, reason="local",
                    started_s=1.5)
    health.dispatched(probe)
    # Non-streaming, its client left before any answer: the wait was cancelled, with no
    # failure and no first byte (forward_unary marks nothing else).
    health.attempt_finished(probe)
    assert health.state_of("a") is BreakerState.HALF_OPEN  # not readmitted
    assert [v.worker_id for v in health.filter([view("a"), view("b")], 1.6)] == ["a", "b"]


def test_penalties_of_a_large_fleet_are_recomputed_at_a_bounded_rate() -> None:
    """A recomputation visits every sampled worker: with many, a new sample waits for
    REFRESH_S_PER_WORKER x their number before it shows (at most ~1 % of a core), never
    longer than PENALTY_REFRESH_S."""
    penalties = RegionPenalties(10.0)
    for index in range(400):
        sent = attempt(f"us-{index}", None, "us-east", ttfb_s=0.050, predicted_ms=50.0)
        penalties.learn(sent, 0.0)
    assert penalties.penalty_ms("us-east", 0.0) == 0.0  # computed: as predicted
    for index in range(400):
        slow = attempt(f"us-{index}", None, "us-east", ttfb_s=5.050, predicted_ms=50.0)
        penalties.learn(slow, 0.0)
    assert penalties.penalty_ms("us-east", 0.01) == 0.0  # 400 workers: 40 ms between
    assert penalties.penalty_ms("us-east", 0.04) > 900.0


def test_first_bytes_late_now_penalise_their_region_before_they_come() -> None:
    """A region that turns slow at once (300 ms more RTT) is penalised by its streams still
    waiting, as soon as they overrun on several of its workers, not seconds later when
    those first bytes have come and been averaged in; once they come (or the round
    cannot judge), only what was learnt remains."""
    views = {"us-1": view("us-1"), "us-2": view("us-2"), "eu-1": view("eu-1", "eu-west")}
    clock = FakeClock(0.0)
    health = Health(POLICY, clock=clock, views=lambda: views)
    for _ in range(20):  # as predicted, everywhere
        for worker_id, region in (("us-1", "us-east"), ("us-2", "us-east"),
                                  ("eu-1", "eu-west")):
            health.attempt_finished(attempt(worker_id, None, region, ttfb_s=0.050))
    waiting = [streaming("us-1", "us-east", 10.0), streaming("us-2", "us-east", 10.05)]
    for sent in waiting:
        sent.predicted_ttft_ms = 50.0
        health.dispatched(sent)
    assert health.quiet
    clock.now = 10.2  # us-1's has waited 200 ms, 150 beyond its prediction; us-2's 100
    health.check_overdue()
    assert health.region_penalty_ms("us-east", 10.2) == pytest.approx(100.0 - FLOOR, abs=1)
    assert health.region_penalty_ms("eu-west", 10.2) == 0.0
    # us-1 is later than its region's penalty says: scored so much beyond its prediction.
    assert health.overdue_ms == {"us-1": pytest.approx(150.0 - FLOOR - (100.0 - FLOOR), abs=1)}
    clock.now = 10.4
    health.check_overdue(late=True)  # the check itself ran late: judges nothing new...
    assert health.region_penalty_ms("us-east", 10.4) == pytest.approx(100.0 - FLOOR, abs=1)
    clock.now = 10.5
    health.check_overdue(late=True)  # ...and its last judgement stands only so long
    assert health.region_penalty_ms("us-east", 10.5) == 0.0 and health.overdue_ms == {}
    clock.now = 10.4
    health.check_overdue()
    assert health.region_penalty_ms("us-east", 10.4) == pytest.approx(300.0 - FLOOR, abs=1)
    # One slow worker alone is its own business, not its region's: it alone is scored
    # beyond its prediction, so that its sibling takes its requests.
    waiting[1].first_byte_s = 10.12
    health.attempt_finished(waiting[1])
    health.check_overdue()
    assert health.region_penalty_ms("us-east", 10.4) < 10.0
    assert set(health.overdue_ms) == {"us-1"} and health.overdue_ms["us-1"] > 300.0
    # Come at last: its real wait is learnt (one sample, weighted 0.2), the overrun gone.
    waiting[0].first_byte_s = 10.45
    health.attempt_finished(waiting[0])
    health.check_overdue()
    assert health.region_penalty_ms("us-east", 10.45) == 0.0  # us-2 answered on time
    assert health.overdue_ms == {} and health.quiet


def test_overdue_streams_in_one_region_leave_the_others_alone() -> None:
    """Overruns of a region that has a single worker count at once (there is no second
    to ask), a non-streaming wait (its first byte is its whole answer) never, and a wait
    within the noise floor of its prediction is not an overrun."""
    views = {"eu-1": view("eu-1", "eu-west"), "us-1": view("us-1")}
    clock = FakeClock(0.0)
    health = Health(POLICY, clock=clock, views=lambda: views)
    late = streaming("eu-1", "eu-west", 0.0)
    whole = streaming("us-1", "us-east", 0.0)
    whole.streamed = False
    for sent in (late, whole):
        sent.predicted_ttft_ms = 100.0
        health.dispatched(sent)
    clock.now = 0.12  # 20 ms over: noise
    health.check_overdue()
    assert health.region_penalties(0.12) == {}
    clock.now = 0.5
    health.check_overdue()
    assert health.region_penalty_ms("eu-west", 0.5) == pytest.approx(400.0 - FLOOR, abs=1)
    assert health.region_penalty_ms("us-east", 0.5) == 0.0


def test_opening_a_connection_is_not_the_paths_delay() -> None:
    """A region that just took traffic opens connections to its workers: the handshakes'
    round trips are a one-off wait, which must not be learnt as the path's slowness (the
    region then looked ~80 ms slower than predicted for its first seconds)."""
    views = {"eu-1": view("eu-1", "eu-west"), "eu-2": view("eu-2", "eu-west")}

    def penalty_after(ttfb_s: float, connect_s: float) -> float:
        health = Health(POLICY, clock=FakeClock(0.0), views=lambda: views)
        for worker_id in ("eu-1", "eu-2"):
            for _ in range(5):  # predicted: 50 ms of RTT, 0 of engine
                sent = attempt(worker_id, None, "eu-west", ttfb_s=ttfb_s, predicted_ms=50.0)
                sent.prediction = Prediction(50.0, 0.0, 0.0, 0.0, 0.0)
                sent.connect_s = connect_s
                health.attempt_finished(sent)
        return health.region_penalty_ms("eu-west", 0.0)

    assert penalty_after(0.150, 0.100) == 0.0  # a handshake of two round trips: excused
    assert penalty_after(0.150, 0.0) > 50.0  # the same wait on kept-alive connections
    # A handshake far slower than its round trips is the path's slowness too: only two
    # predicted round trips (100 ms) of its 300 are excused.
    assert penalty_after(0.400, 0.300) == pytest.approx(250.0 - FLOOR, abs=1)


def test_a_step_in_a_paths_delay_is_believed_at_its_second_sample() -> None:
    """Two misses in a row 300 ms beyond a worker's mean replace the mean (an average
    weighted 0.2 would take ~5 samples, and a region traffic has left sends no more);
    one stray miss is only averaged in; the way back down is as quick."""
    views = {"us-1": view("us-1"), "us-2": view("us-2")}
    clock = FakeClock(0.0)
    health = Health(POLICY, clock=clock, views=lambda: views)

    def answered(ttfb_s: float) -> None:
        for worker_id in views:
            health.attempt_finished(attempt(worker_id, None, "us-east", ttfb_s=ttfb_s))

    for _ in range(10):
        answered(0.050)  # as predicted
    answered(0.350)  # one stray miss: averaged in (0.2 x 300 ms)
    assert health.region_penalty_ms("us-east", 0.0) == pytest.approx(60.0 - FLOOR, abs=1)
    answered(0.050)
    answered(0.350)
    answered(0.350)  # the second in a row: the path slowed by 300 ms
    assert health.region_penalty_ms("us-east", 0.0) == pytest.approx(300.0 - FLOOR, abs=1)
    answered(0.050)
    answered(0.050)  # healed: believed as soon
    assert health.region_penalty_ms("us-east", 0.0) == 0.0


def test_copies_that_outran_their_originals_confirm_a_step_up() -> None:
    """Originals a hedged copy outran are known only to have waited at least so long;
    two in a row 300 ms beyond the mean still show that the path slowed at once."""
    views = {"us-1": view("us-1"), "us-2": view("us-2")}
    health = Health(POLICY, clock=FakeClock(0.0), views=lambda: views)

    def finished(ttfb_s: float, *, outrun: bool = False) -> None:
        for worker_id in views:
            late = attempt(worker_id, None, "us-east", ttfb_s=None if outrun else ttfb_s)
            late.outrun, late.finished_s = outrun, ttfb_s
            health.attempt_finished(late)

    for _ in range(10):
        finished(0.050)
    finished(0.350, outrun=True)
    assert health.region_penalty_ms("us-east", 0.0) == pytest.approx(60.0 - FLOOR, abs=1)
    finished(0.350, outrun=True)  # the second in a row: the path is at least this slow
    assert health.region_penalty_ms("us-east", 0.0) == pytest.approx(300.0 - FLOOR, abs=1)
    finished(0.100, outrun=True)  # a lower bound below the mean lowers nothing
    assert health.region_penalty_ms("us-east", 0.0) == pytest.approx(300.0 - FLOOR, abs=1)


def us_east_slowed_by_300_ms(clock: FakeClock) -> Health:
    """A Health whose two us-east workers each answered once as predicted, then twice
    300 ms late (a step, believed), at `clock`'s time."""
    views = {"us-1": view("us-1"), "us-2": view("us-2")}
    health = Health(POLICY, clock=clock, views=lambda: views)
    for ttfb_s in (0.050, 0.350, 0.350):
        for worker_id in views:
            health.attempt_finished(attempt(worker_id, None, "us-east", ttfb_s=ttfb_s))
    return health


def sent_to_us_east(health: Health, worker_id: str, at_s: float, *,
                    stream: bool = True) -> Attempt:
    """An attempt on `worker_id` in us-east, sent at `at_s` and told to `health`."""
    sent = attempt(worker_id, None, "us-east", ttfb_s=None)
    sent.started_s, sent.streamed = at_s, stream
    health.dispatched(sent)
    return sent


def test_outrun_originals_restore_a_penalty_that_has_decayed() -> None:
    """A slow region's penalty decays while traffic stays away; the requests then sent
    back are outrun by their copies, and what they waited, a lower bound below the old
    peak but above the decayed mean, must bring the penalty back."""
    clock = FakeClock(0.0)
    health = us_east_slowed_by_300_ms(clock)
    assert health.region_penalty_ms("us-east", 0.0) == pytest.approx(300.0 - FLOOR, abs=1)
    clock.now = 40.0  # four half-lives (10 s): decayed to ~19 ms, below the floor
    assert health.region_penalty_ms("us-east", clock.now) == 0.0
    for _ in range(2):
        for worker_id in ("us-1", "us-2"):
            late = attempt(worker_id, None, "us-east", ttfb_s=None)
            late.outrun, late.finished_s = True, 0.250  # outrun after 250 ms
            health.attempt_finished(late)
    assert health.region_penalty_ms("us-east", clock.now) == pytest.approx(
        200.0 - FLOOR, abs=5)


def test_a_miss_the_whole_fleet_shares_sends_nothing_away_from_busy_local_workers() -> None:
    """Every region's first bytes come 150 ms later than predicted (predictions low for
    a busy host): nobody's path. Local workers with streams in flight (the idle remote
    ones have none) must not be scored slower for it, nor their region penalised; a
    stream still opening its connection is allowed the handshakes' two round trips."""
    views = {"us-1": view("us-1"), "us-2": view("us-2"),
             "eu-1": view("eu-1", "eu-west"), "eu-2": view("eu-2", "eu-west")}
    clock = FakeClock(10.0)
    health = Health(POLICY, clock=clock, views=lambda: views)
    for _ in range(5):
        for worker_id, worker in views.items():
            health.attempt_finished(attempt(worker_id, None, worker.region, ttfb_s=0.200))
    for worker_id in ("us-1", "us-2"):
        health.dispatched(streaming(worker_id, "us-east", 10.0))
    connecting = streaming("eu-1", "eu-west", 10.0)  # opening its connection (TLS)
    connecting.prediction = Prediction(80.0, 0.0, 0.0, 0.0, 0.0)
    connecting.predicted_ttft_ms = 80.0
    connecting.connecting = True
    health.dispatched(connecting)
    clock.now = 10.2  # waited 200 ms each, as every first byte lately
    health.check_overdue()
    assert health.region_penalties(10.2) == {"us-east": 0.0, "eu-west": 0.0}
    assert health.overdue_ms == {}


def test_a_region_traffic_left_is_tried_again_by_one_stream_at_a_time() -> None:
    """While a slow region's penalty decays with nothing learnt from it, the first stream
    sent there is a probe: until it is learnt from, the region is scored at the penalty
    it was last learnt at, so the decay sends one stream back, not a wave of them."""
    clock = FakeClock(0.0)
    health = us_east_slowed_by_300_ms(clock)
    learnt = 300.0 - FLOOR
    assert health.region_penalty_ms("us-east", 0.0) == pytest.approx(learnt, abs=1)

    # A region in use (found again within a second: decayed by less than the noise
    # floor) has no probe: its streams are scored at its penalty.
    recent = sent_to_us_east(health, "us-1", 1.0)
    assert health.region_penalty_ms("us-east", 1.0) == pytest.approx(
        300.0 * 0.5 ** 0.1 - FLOOR, abs=1)
    recent.finished_s = 1.1  # (its client left: nothing learnt)
    clock.now = 20.0  # two half-lives: decayed to a quarter
    decayed = 300.0 / 4 - FLOOR
    assert health.region_penalty_ms("us-east", clock.now) == pytest.approx(decayed, abs=1)
    # A non-streaming request teaches nothing of the path: it is no probe.
    sent_to_us_east(health, "us-1", 20.0, stream=False)
    assert health.region_penalty_ms("us-east", 20.0) == pytest.approx(decayed, abs=1)
    probe = sent_to_us_east(health, "us-1", 20.0)
    assert health.region_penalty_ms("us-east", 20.0) == pytest.approx(learnt, abs=1)
    assert health.region_penalties(20.0)["us-east"] == pytest.approx(learnt, abs=1)
    sent_to_us_east(health, "us-2", 20.1)  # sent there all the same: not a probe
    assert health.region_penalty_ms("us-east", 20.2) == pytest.approx(learnt, abs=1)
    # The probe's first byte is 300 ms late again: the region is still as it was found,
    # its penalty is back and decays from now (as a breaker's failed half-open probe
    # opens it again), though only one of its workers answered.
    probe.first_byte_s, probe.finished_s = 20.35, 20.5
    clock.now = 20.5
    health.attempt_finished(probe)
    assert health.region_penalty_ms("us-east", 20.5) == pytest.approx(learnt, abs=1)
    assert health.region_penalty_ms("us-east", 40.5) == pytest.approx(decayed, abs=1)
    # Two half-lives on, the next stream there is the next probe. One never learnt from
    # holds its region for PROBE_HOLD_S at most.
    second = sent_to_us_east(health, "us-2", 40.5)
    assert health.region_penalty_ms("us-east", 40.5) == pytest.approx(learnt, abs=1)
    assert health.region_penalty_ms("us-east", 40.5 + PROBE_HOLD_S + 0.1) < decayed
    assert second.finished_s is None


def test_a_probe_that_finds_the_region_healed_lets_traffic_back() -> None:
    """A probe that answers as predicted (or faster than the decayed penalty says) has
    found the region healed: traffic goes back at once, not after a wave of samples."""
    clock = FakeClock(0.0)
    health = us_east_slowed_by_300_ms(clock)
    clock.now = 20.0
    probe = sent_to_us_east(health, "us-1", clock.now)
    assert health.region_penalty_ms("us-east", clock.now) > 250.0
    # A copy that outran it says only that it took at least so long: not healed.
    probe.outrun, probe.finished_s = True, 20.06
    clock.now = 20.06
    health.attempt_finished(probe)
    assert health.region_penalty_ms("us-east", clock.now) > 40.0
    clock.now = 21.0
    probe = sent_to_us_east(health, "us-2", clock.now)
    probe.first_byte_s = clock.now + 0.05  # as predicted: the path healed
    clock.now += 0.2
    probe.finished_s = clock.now
    health.attempt_finished(probe)
    assert health.region_penalty_ms("us-east", clock.now) == 0.0
    sent_to_us_east(health, "us-1", clock.now + 2.0)
    assert health.region_penalty_ms("us-east", clock.now + 2.0) == 0.0


def test_a_region_found_only_by_outrun_streams_is_probed_once_it_decays_at_all() -> None:
    """A region turns slow; its streams' hedged copies outrun them, so what it is found
    at is a lower bound (here 150 ms late at least, where the path is 300 ms slower).
    Its penalty must not decay into a wave of streams sent back: the first stream sent
    there is a probe, as soon as the penalty has decayed at all, and the probe's whole
    answer (300 ms late) is what the region is found at from then on."""
    views = {"us-1": view("us-1"), "us-2": view("us-2")}
    clock = FakeClock(0.0)
    health = Health(POLICY, clock=clock, views=lambda: views)
    for worker_id in views:
        health.attempt_finished(attempt(worker_id, None, "us-east", ttfb_s=0.050))
        for _ in range(2):
            late = attempt(worker_id, None, "us-east", ttfb_s=None)
            late.outrun, late.finished_s = True, 0.200  # its copy answered at 200 ms
            health.attempt_finished(late)
    bound = 150.0 - FLOOR
    assert health.region_penalty_ms("us-east", 0.0) == pytest.approx(bound, abs=1)
    clock.now = 2.0  # decayed by ~19 ms: less than the noise floor
    assert health.region_penalty_ms("us-east", 2.0) == pytest.approx(150.0 * 0.5 ** 0.2 - FLOOR,
                                                                   abs=1)
    probe = sent_to_us_east(health, "us-1", 2.0)
    assert probe.probe
    assert health.region_penalty_ms("us-east", 2.0) == pytest.approx(bound, abs=1)
    sent = sent_to_us_east(health, "us-2", 2.05)  # while it is out: not another probe
    assert not sent.probe
    probe.first_byte_s, probe.finished_s = 2.35, 2.4  # its whole answer: 300 ms late
    clock.now = 2.4
    health.attempt_finished(probe)
    assert health.region_penalty_ms("us-east", 2.4) == pytest.approx(300.0 - FLOOR, abs=1)
