"""Hedged first tokens: a stream whose first token is late gets a second copy elsewhere.

A stream that opted in (its traffic class in `router.hedging.classes`, or the header
`x-globalpool-hedge: on`) and has no first event `delay` after it was sent is sent again
to the next-best worker, in another region if one can take it. The first of the two to
produce a whole first event answers the client; the other's connection is closed, which
makes vLLM abort the request (the engine stops work on it). The delay is the request's
predicted TTFT times the recent `quantile` of measured over predicted TTFT
(`HedgeDelay`), within the configured bounds, and at most half the client's TTFT budget
if it gave one; the extra load is capped by `HedgeBudget`: over N eligible streams at
most `max_fraction` x N + `max_burst` copies that lost. A copy that answers first is
refunded: it replaced an original that was late (and is aborted), so the engines did the
answer once, not twice; while a place stays slow, every late stream there gets its copy.

Only streams are hedged: a non-streaming answer shows no first token, so a hedge there
would run the whole answer twice.

A region's probe (router.health.penalties: traffic left a slow region, and one stream
finds out whether it is still slow) is hedged at the delay of its prediction without the
region's penalty, which is what the probe tests: its client waits no longer than a healed
region would make it. A probe outrun by its copy is not cancelled but kept until its
first byte (at most PROBE_KEPT_S), then closed: what it finds holds for its region, and
a probe cut short would find nothing and make the next stream there a probe again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from router.config import HedgingConfig
from router.core.outcome import Attempt, RequestRecord
from router.health.penalties import PROBE_HOLD_S
from router.policy import Decision, NoRoute, Policy, RouteRequest
from router.proxy.failures import UpstreamFailure
from router.proxy.targets import target_of
from router.proxy.upstream.connection import UpstreamConnection
from router.proxy.upstream.pool import UpstreamPool
from router.registry.inflight import InFlight
from router.registry.snapshot import Snapshot

HEDGE_HEADER = "x-globalpool-hedge"  # on | off: the client's choice for this request

# The delay's ratio until MIN_SAMPLES streams were measured: twice the prediction.
DEFAULT_RATIO = 2.0
MIN_SAMPLES = 20
# Where a copy would go is looked up again this often, per model and region of the
# original, and connections opened there ahead (`Hedges.warm`): to this many workers, as
# many to each as this router's streams in the original's region would need if they all
# moved there, up to WARM_PER_WORKER.
WARM_EVERY_S = 0.5
WARM_WORKERS = 2
WARM_PER_WORKER = 8
# An outrun probe is kept this long at most for its first byte (as long as its region is
# held for it).
PROBE_KEPT_S = PROBE_HOLD_S

# What `open_stream` gives: the connection, its first bytes, whether it was refused.
Opened = tuple[UpstreamConnection, bytes, bool]


class HedgeBudget:
    """At most a share of the eligible requests hedged in vain: each adds that share of a
    token (saved up to `cap`, the largest burst), a copy spends one, and a copy that
    answered first gives it back (`refund`)."""

    __slots__ = ("_cap", "_tokens", "denied", "refunded", "sent")

    def __init__(self, cap: float = 20.0) -> None:
        self._cap = max(1.0, cap)
        self._tokens = 1.0
        self.sent = 0
        self.denied = 0
        self.refunded = 0

    def eligible(self, ratio: float, cap: float) -> None:
        """An eligible request arrived (`ratio`, `cap`: as configured now)."""
        self._cap = max(1.0, cap)
        self._tokens = min(self._cap, self._tokens + ratio)

    def try_spend(self) -> bool:
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            self.sent += 1
            return True
        self.denied += 1
        return False

    def refund(self) -> None:
        """A copy answered first: its token comes back (up to the cap)."""
        self._tokens = min(self._cap, self._tokens + 1.0)
        self.refunded += 1


class HedgeDelay:
    """How long to wait for a first token before hedging: the prediction times a recent
    quantile of measured over predicted TTFT (an observer of finished attempts: the
    streams' first bytes against their predictions, the last `size` of them)."""

    __slots__ = ("_index", "_quantile", "_ratios", "_size", "_sorted", "_stale")

    def __init__(self, size: int = 512) -> None:
        self._size = size
        self._ratios: list[float] = []
        self._index = 0
        self._sorted: list[float] = []
        self._stale = 0
        self._quantile = 0.9

    def attempt_finished(self, attempt: Attempt) -> None:
        first_s = attempt.first_byte_s
        predicted_ms = attempt.predicted_ttft_ms
        if (first_s is None or not attempt.streamed or predicted_ms <= 0.0
                or attempt.status != 200):
            return
        ratio = (first_s - attempt.started_s) * 1000.0 / predicted_ms
        if len(self._ratios) < self._size:
            self._ratios.append(ratio)
        else:
            self._ratios[self._index] = ratio
            self._index = (self._index + 1) % self._size
        self._stale += 1

    def request_finished(self, record: RequestRecord) -> None:
        return None

    def ratio(self, quantile: float) -> float:
        """The `quantile` of the recent measured/predicted ratios (sorted again every 16
        new ones)."""
        if len(self._ratios) < MIN_SAMPLES:
            return DEFAULT_RATIO
        if self._stale >= 16 or quantile != self._quantile or not self._sorted:
            self._sorted = sorted(self._ratios)
            self._stale = 0
            self._quantile = quantile
        ranked = self._sorted
        return ranked[min(len(ranked) - 1, int(quantile * len(ranked)))]

    def delay_s(self, predicted_ms: float, settings: HedgingConfig) -> float:
        """The wait for `predicted_ms`, within the configured bounds."""
        delay_ms = predicted_ms * self.ratio(settings.quantile)
        return min(settings.max_delay_ms, max(settings.min_delay_ms, delay_ms)) / 1000.0


class Hedge:
    """One stream that may be hedged: its wait, the route of its copy, and its attempts
    with their decisions."""

    __slots__ = ("_budget", "_decisions", "delay_s", "primary", "route")

    def __init__(self, delay_s: float, route: RouteRequest, primary: Attempt,
                 decision: Decision, budget: HedgeBudget) -> None:
        self.delay_s = delay_s
        self.route = route
        self.primary = primary
        self._decisions = [(primary, decision)]
        self._budget = budget

    def spend(self) -> bool:
        """Whether the budget lets the copy go."""
        return self._budget.try_spend()

    def sent(self, attempt: Attempt, decision: Decision) -> None:
        attempt.reason = "hedge"
        attempt.hedge_delay_s = self.delay_s
        self._decisions.append((attempt, decision))

    def decision_of(self, attempt: Attempt) -> Decision:
        return next(decision for each, decision in self._decisions if each is attempt)


class Hedges:
    """A replica's hedging: its budget and its delay (`HedgeDelay` learns from every
    stream's attempt, through the proxy)."""

    __slots__ = ("_warm_at", "budget", "delay")

    def __init__(self) -> None:
        self.budget = HedgeBudget()
        self.delay = HedgeDelay()
        self._warm_at: dict[tuple[str, str], float] = {}

    def warm(self, hedge: Hedge, pool: UpstreamPool, policy: Policy, snapshot: Snapshot,
             inflight: InFlight) -> None:
        """Connections opened ahead to where `hedge`'s copy would go now, every
        WARM_EVERY_S at most per model and region of the original: to the WARM_WORKERS
        workers its route ranks first, enough to each for this router's open requests in
        the original's region to move there (up to WARM_PER_WORKER). A copy that must
        first connect to another region waits a round trip more there (TLS, more), and
        copies are sent just when a region turns slow, before traffic (and with it kept
        connections) has gone elsewhere."""
        route, region, now_s = hedge.route, hedge.primary.region, hedge.primary.started_s
        key = (route.model, region)
        if self._warm_at.get(key, 0.0) > now_s:
            return
        if len(self._warm_at) > 4096:  # models x regions: bounded by the fleet, but bound it
            self._warm_at.clear()
        self._warm_at[key] = now_s + WARM_EVERY_S
        workers = snapshot.workers
        moving = 0
        for worker_id, open_requests in inflight.own_counts().items():
            view = workers.get(worker_id)
            if view is not None and view.region == region:
                moving += open_requests
        count = min(WARM_PER_WORKER, 1 + moving // WARM_WORKERS)
        for _ in range(WARM_WORKERS):
            try:
                worker = policy.pick(snapshot, route).worker
            except NoRoute:
                return
            target = target_of(worker.endpoint)
            pool.warm(target.host, target.port, count, target.ssl)
            route = route._replace(exclude=route.exclude | {worker.worker_id})

    def prepare(self, settings: HedgingConfig, decision: Decision, attempt: Attempt,
                route: RouteRequest) -> Hedge:
        """An eligible stream's hedge: when, and where its copy may go (not its worker;
        another region if one can take it)."""
        self.budget.eligible(settings.max_fraction, settings.max_burst)
        predicted_ms = decision.predicted_ttft_ms
        if attempt.probe and decision.prediction is not None:
            predicted_ms -= decision.prediction.penalty_ms  # (see the module's doc)
        delay_s = self.delay.delay_s(predicted_ms, settings)
        budget_ms = route.ttft_budget_ms
        if budget_ms is not None:  # a copy while half the client's budget is left
            delay_s = min(delay_s, max(settings.min_delay_ms, budget_ms / 2) / 1000.0)
        return Hedge(delay_s,
                     route._replace(exclude=route.exclude | {attempt.worker_id},
                                    avoid_regions=frozenset((attempt.region,))),
                     attempt, decision, self.budget)

    async def first_to_start(
        self, primary: Coroutine[Any, Any, Opened], hedge: Hedge,
        send_hedge: Callable[[], tuple[Attempt, Coroutine[Any, Any, Opened]] | None],
        lost: Callable[[Attempt, UpstreamFailure | None], None], record: RequestRecord,
    ) -> tuple[Attempt, Opened]:
        """`first_to_start` for `hedge`; the attempt that answers is made the record's
        last (the one that served it)."""
        winner, opened = await first_to_start(primary, hedge.delay_s, send_hedge,
                                              hedge.primary, lost)
        if winner is not hedge.primary:
            self.budget.refund()
        if record.attempts[-1] is not winner:
            record.attempts.remove(winner)
            record.attempts.append(winner)
        return winner, opened


def hedge_wanted(settings: HedgingConfig, headers: Mapping[str, str],
                 traffic_class: str) -> bool:
    """Whether a stream may be hedged: its client asked (`x-globalpool-hedge: on`), or its
    class is hedged by regions.yaml and its client did not opt out (`off`)."""
    said = headers.get(HEDGE_HEADER)
    if said is not None:
        said = said.lower()
        if said == "off":
            return False
        if said == "on":
            return True
    return traffic_class in settings.classes


async def first_to_start(
    primary: Coroutine[Any, Any, Opened],
    delay_s: float,
    send_hedge: Callable[[], tuple[Attempt, Coroutine[Any, Any, Opened]] | None],
    primary_attempt: Attempt,
    lost: Callable[[Attempt, UpstreamFailure | None], None],
) -> tuple[Attempt, Opened]:
    """Open `primary`; if it has no first event after `delay_s`, `send_hedge()` (None: no
    hedge now) and take whichever of the two opens first. The other is cancelled (its
    connection closed: the engine aborts it) and its attempt given to `lost` with its
    failure, if it failed. When one fails before its first event the other is awaited;
    when both fail, the hedge is `lost` and the primary's failure raised. Returns the
    attempt that answers and what it opened."""
    # (No `await` in an `except` block before a bare `raise`: in the compiled build the
    # exception re-raised after one is not the one caught, and crashes the process.)
    first = asyncio.ensure_future(primary)
    try:
        done, _ = await asyncio.wait((first,), timeout=delay_s)
        if done:
            return primary_attempt, first.result()
        hedge = send_hedge()
        if hedge is None:
            return primary_attempt, await first
    except BaseException:
        _stop(first)
        raise
    hedge_attempt, opening = hedge
    tasks: dict[asyncio.Future[Opened], Attempt] = {
        first: primary_attempt, asyncio.ensure_future(opening): hedge_attempt}
    try:
        return await _first_opened(tasks, first, lost)
    except BaseException:
        for task in tasks:
            _stop(task)
        raise


async def _first_opened(
    tasks: dict[asyncio.Future[Opened], Attempt], primary: asyncio.Future[Opened],
    lost: Callable[[Attempt, UpstreamFailure | None], None],
) -> tuple[Attempt, Opened]:
    """The first of `tasks` to open; the other stopped and `lost`."""
    pending = set(tasks)
    failures: dict[asyncio.Future[Opened], UpstreamFailure] = {}
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        # The primary first when both came at once: it was sent first.
        for task in sorted(done, key=lambda t: t is not primary):
            error = task.exception()
            if error is None:
                (other,) = (t for t in tasks if t is not task)
                outrun = tasks[other]
                if outrun.probe and not other.done():
                    _keep_probe(other, outrun, lost)
                else:
                    _stop(other)
                    lost(outrun, failures.get(other))
                return tasks[task], task.result()
            if not isinstance(error, UpstreamFailure):
                raise error
            failures[task] = error
    (hedge,) = (t for t in tasks if t is not primary)
    lost(tasks[hedge], failures[hedge])
    raise failures[primary]


def _keep_probe(task: asyncio.Future[Opened], attempt: Attempt,
                lost: Callable[[Attempt, UpstreamFailure | None], None]) -> None:
    """An outrun probe: left to open (its first byte learnt from), then closed and `lost`;
    cancelled after PROBE_KEPT_S."""
    timer = asyncio.get_running_loop().call_later(PROBE_KEPT_S, task.cancel)

    def ended(task: asyncio.Future[Opened]) -> None:
        timer.cancel()
        failure = None
        if not task.cancelled():
            error = task.exception()
            if error is None:
                task.result()[0].close()
            elif isinstance(error, UpstreamFailure):
                failure = error
        lost(attempt, failure)

    task.add_done_callback(ended)


def _stop(task: asyncio.Future[Opened]) -> None:
    """Cancel `task` (its connection closed as the cancellation reaches it: the engine
    aborts the request); an answer it opened, or opens before that, is closed unread."""
    if task.done():
        _close_opened(task)
    else:
        task.cancel()
        task.add_done_callback(_close_opened)


def _close_opened(task: asyncio.Future[Opened]) -> None:
    if not task.cancelled() and task.exception() is None:
        task.result()[0].close()
