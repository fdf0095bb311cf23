"""Hedging's budget, its delay and who may be hedged (router.proxy.hedging), and how a
race ends for a region's probe (on real loopback connections); the race itself runs on
real simulators in tests/integration/test_hedging.py."""

from __future__ import annotations

import asyncio
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from router.config import HedgingConfig
from router.core.outcome import Attempt, Prediction
from router.policy import Decision, RouteRequest
from router.proxy import hedging
from router.proxy.failures import UpstreamFailure
from router.proxy.hedging import (
    DEFAULT_RATIO,
    MIN_SAMPLES,
    HedgeBudget,
    HedgeDelay,
    Hedges,
    Opened,
    first_to_start,
    hedge_wanted,
)
from router.proxy.upstream.pool import UpstreamPool
from tests.unit.test_queue import view


def _stream(ttfb_ms: float, predicted_ms: float, status: int = 200) -> Attempt:
    attempt = Attempt(worker_id="w", region="r", predicted_ttft_ms=predicted_ms,
                      reason="local", started_s=100.0, streamed=True)
    attempt.first_byte_s = 100.0 + ttfb_ms / 1000
    attempt.status = status
    return attempt


@given(st.floats(min_value=0.0, max_value=1.0), st.integers(min_value=1, max_value=2000))
def test_the_budget_never_hedges_more_than_its_share_and_a_burst(ratio: float,
                                                                 requests: int) -> None:
    budget = HedgeBudget(cap=5.0)
    hedged = 0
    for _ in range(requests):
        budget.eligible(ratio, 5.0)
        hedged += budget.try_spend()  # every one late: the worst case
    assert hedged <= 1 + ratio * requests + 1e-9
    assert budget.sent == hedged and budget.sent + budget.denied == requests


@given(st.floats(min_value=0.0, max_value=1.0), st.lists(st.booleans(), max_size=2000))
def test_copies_that_lose_stay_within_the_share_however_many_win(ratio: float,
                                                                  wins: list[bool]) -> None:
    """A copy that answers first is refunded: only the copies that lost (the answers run
    twice) are bounded by the share and the burst."""
    budget = HedgeBudget(cap=5.0)
    lost = 0
    for won in wins:  # every stream late; whether its copy outruns it, as drawn
        budget.eligible(ratio, 5.0)
        if budget.try_spend():
            if won:
                budget.refund()
            else:
                lost += 1
    assert lost <= 1 + ratio * len(wins) + 1e-9
    assert budget.refunded == budget.sent - lost


def test_while_copies_win_every_late_stream_gets_one() -> None:
    """A region gone slow all at once: its streams are late and their copies answer first,
    so the burst never runs out (without the refund, 5 of the 100 would get a copy)."""
    budget = HedgeBudget()
    hedged = 0
    for _ in range(100):
        budget.eligible(0.05, 5)
        if budget.try_spend():
            hedged += 1
            budget.refund()
    assert hedged == 100 and budget.denied == 0


def test_the_budget_lets_its_share_through_when_every_stream_is_late() -> None:
    budget = HedgeBudget()
    for _ in range(1000):
        budget.eligible(0.05, 20)
        budget.try_spend()
    assert 50 <= budget.sent <= 51


def test_a_burst_of_late_streams_spends_at_most_the_cap() -> None:
    budget = HedgeBudget()
    for _ in range(100):
        budget.eligible(0.5, 5)  # 100 arrive at once, then all are late
    assert sum(budget.try_spend() for _ in range(100)) == 5


def test_the_delay_is_twice_the_prediction_until_streams_were_measured() -> None:
    delay = HedgeDelay()
    settings = HedgingConfig(min_delay_ms=0.0)
    assert delay.delay_s(100.0, settings) == pytest.approx(0.2)
    for _ in range(MIN_SAMPLES - 1):
        delay.attempt_finished(_stream(300.0, 100.0))
    assert delay.delay_s(100.0, settings) == pytest.approx(0.2)


def test_the_delay_follows_the_quantile_of_measured_over_predicted() -> None:
    delay = HedgeDelay()
    for ratio in range(1, 101):  # measured = 1x .. 100x the prediction, 10 ms predicted
        delay.attempt_finished(_stream(10.0 * ratio, 10.0))
    assert delay.ratio(0.9) == pytest.approx(91.0)
    assert delay.ratio(0.5) == pytest.approx(51.0)
    settings = HedgingConfig(quantile=0.9, min_delay_ms=0.0, max_delay_ms=10_000.0)
    assert delay.delay_s(10.0, settings) == pytest.approx(0.91)


def test_the_delay_stays_within_its_bounds() -> None:
    delay = HedgeDelay()
    settings = HedgingConfig(min_delay_ms=50.0, max_delay_ms=400.0)
    assert delay.delay_s(1.0, settings) == pytest.approx(0.05)
    assert delay.delay_s(10_000.0, settings) == pytest.approx(0.4)


def test_the_delay_learns_only_from_streams_that_answered() -> None:
    delay = HedgeDelay()
    for _ in range(50):
        delay.attempt_finished(_stream(1000.0, 10.0, status=500))  # refused
        unanswered = _stream(0.0, 10.0)
        unanswered.first_byte_s = None  # outrun by its copy, or failed before it
        delay.attempt_finished(unanswered)
        not_predicted = _stream(1000.0, 0.0)
        delay.attempt_finished(not_predicted)
    assert delay.ratio(0.9) == DEFAULT_RATIO


def test_the_delay_keeps_the_recent_streams_only() -> None:
    delay = HedgeDelay(size=64)
    for _ in range(64):
        delay.attempt_finished(_stream(1000.0, 10.0))  # 100x: an old bad spell
    for _ in range(64):
        delay.attempt_finished(_stream(20.0, 10.0))
    assert delay.ratio(0.9) == pytest.approx(2.0)


@pytest.mark.parametrize(("classes", "header", "traffic_class", "wanted"), [
    ([], None, "interactive", False),  # off by default
    ([], "on", "interactive", True),
    ([], "ON", "batch", True),  # a client may hedge even a batch request, on its budget
    (["interactive"], None, "interactive", True),
    (["interactive"], "off", "interactive", False),
    (["interactive"], None, "batch", False),
    (["interactive"], "maybe", "interactive", True),  # not a choice: the class decides
])
def test_who_is_hedged(classes: list[str], header: str | None, traffic_class: str,
                       wanted: bool) -> None:
    settings = HedgingConfig.model_validate({"classes": classes})
    headers = {} if header is None else {"x-globalpool-hedge": header}
    assert hedge_wanted(settings, headers, traffic_class) is wanted


def test_bounds_that_cross_are_refused() -> None:
    with pytest.raises(ValidationError, match="min_delay_ms"):
        HedgingConfig(min_delay_ms=500.0, max_delay_ms=100.0)
    with pytest.raises(ValidationError):
        HedgingConfig.model_validate({"classes": ["everyone"]})


@pytest.mark.parametrize(("budget_ms", "delay_s"), [
    (None, 2.0), (3000.0, 1.5), (500.0, 0.25), (60.0, 0.05)])
def test_a_copy_goes_while_half_the_clients_budget_is_left(budget_ms: float | None,
                                                           delay_s: float) -> None:
    hedges = Hedges()  # nothing measured yet: twice the prediction
    settings = HedgingConfig(min_delay_ms=50.0)
    attempt = _stream(0.0, 1000.0)
    route = RouteRequest(model="m", origin_region="us-east", prompt_tokens=10, stream=True,
                         ttft_budget_ms=budget_ms)
    decision = Decision(worker=view("a"), predicted_ttft_ms=1000.0, reason="local",
                        candidates=2)
    hedge = hedges.prepare(settings, decision, attempt, route)
    assert hedge.delay_s == pytest.approx(delay_s)
    # Its copy goes elsewhere: not to `a`, another region if one can take it.
    assert "w" in hedge.route.exclude and hedge.route.avoid_regions == {"r"}


def test_a_probe_is_hedged_at_the_delay_of_a_healed_region() -> None:
    """A region's probe tests whether the region's penalty still holds: its client waits
    for a copy only as long as a healed region would take, not the penalty too."""
    hedges = Hedges()  # nothing measured yet: twice the prediction
    settings = HedgingConfig(min_delay_ms=50.0)
    route = RouteRequest(model="m", origin_region="us-east", prompt_tokens=10, stream=True)
    prediction = Prediction(rtt_ms=1.0, penalty_ms=200.0, queue_ms=0.0, prefill_ms=9.0,
                            first_step_ms=20.0)
    decision = Decision(worker=view("a"), predicted_ttft_ms=prediction.total_ms,
                        reason="local", candidates=2, prediction=prediction)
    for probe, delay_s in ((False, 0.46), (True, 0.06)):
        attempt = _stream(0.0, prediction.total_ms)
        attempt.probe = probe
        hedge = hedges.prepare(settings, decision, attempt, route)
        assert hedge.delay_s == pytest.approx(delay_s)


class _Worker:
    """A loopback server that answers nothing: what matters is when the router closes
    each connection."""

    def __init__(self) -> None:
        self.closed: list[float] = []
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> _Worker:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the router closes it
        self.closed.append(time.monotonic())
        writer.close()

    def stop(self) -> None:
        assert self._server is not None
        self._server.close()


async def _opening(pool: UpstreamPool, port: int, after_s: float) -> Opened:
    """A stream opened on a real connection, its first event `after_s` after it was sent
    (the part of `open_stream` the race sees: cancelled, it closes its connection)."""
    connection = await pool.send("127.0.0.1", port, b"GET / HTTP/1.1\r\nHost: w\r\n\r\n")
    try:
        await asyncio.sleep(after_s)
    except asyncio.CancelledError:
        connection.close()
        raise
    return connection, b"data: {}\n\n", False


def _attempt(reason: str, *, probe: bool = False) -> Attempt:
    return Attempt(worker_id=reason, region=reason, predicted_ttft_ms=10.0, reason=reason,
                   started_s=time.monotonic(), streamed=True, probe=probe)


@pytest.mark.parametrize("probe", [False, True])
async def test_an_outrun_probe_is_kept_until_its_first_byte(probe: bool) -> None:
    """The copy answers first. An original that is not a probe is cancelled at once (its
    connection closed: the engine aborts it); a probe is kept until its first byte, so
    that its region learns whether it is still slow, and then closed."""
    worker = await _Worker().start()
    pool = UpstreamPool(connect_timeout_s=1.0)
    original, copy = _attempt("original", probe=probe), _attempt("copy")
    lost: list[tuple[Attempt, UpstreamFailure | None, float]] = []
    try:
        started = time.monotonic()
        winner, opened = await first_to_start(
            _opening(pool, worker.port, 0.4), 0.05,
            lambda: (copy, _opening(pool, worker.port, 0.02)), original,
            lambda attempt, failure: lost.append((attempt, failure, time.monotonic())))
        assert winner is copy
        opened[0].close()
        for _ in range(200):
            if lost and len(worker.closed) == 2:
                break
            await asyncio.sleep(0.01)
        assert [(attempt, failure) for attempt, failure, _ in lost] == [(original, None)]
        lost_after_s = lost[0][2] - started
        if probe:  # its first event came at 0.4 s: then it was closed and given up
            assert 0.4 <= lost_after_s < 1.0, lost_after_s
        else:
            assert lost_after_s < 0.2, lost_after_s
        assert len(worker.closed) == 2  # both connections closed
    finally:
        await pool.close()
        worker.stop()


async def test_a_probe_kept_for_its_first_byte_is_given_up_after_the_hold(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hedging, "PROBE_KEPT_S", 0.2)
    worker = await _Worker().start()
    pool = UpstreamPool(connect_timeout_s=1.0)
    original, copy = _attempt("original", probe=True), _attempt("copy")
    lost: list[Attempt] = []
    try:
        winner, opened = await first_to_start(
            _opening(pool, worker.port, 30.0), 0.05,
            lambda: (copy, _opening(pool, worker.port, 0.0)), original,
            lambda attempt, failure: lost.append(attempt))
        opened[0].close()
        assert winner is copy and lost == []
        for _ in range(100):
            if lost and len(worker.closed) == 2:
                break
            await asyncio.sleep(0.01)
        assert lost == [original] and len(worker.closed) == 2  # cancelled: closed
    finally:
        await pool.close()
        worker.stop()
