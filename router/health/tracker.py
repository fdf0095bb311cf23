"""Passive health: learn from every attempt's outcome, filter candidates before scoring.

One `Health` per router. It is an observer of attempts (see router.core.outcome) and
the health filter that `Policy.pick` applies for every policy. It never empties the
candidate set: if every candidate is ejected it fails open and returns them all, because
an attempt that might succeed beats a certain 503 (the ejection cap).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from router.core.outcome import Attempt, Failure, RequestRecord
from router.health.breaker import Breaker, BreakerPolicy, BreakerState
from router.health.loop_lag import LoopLag
from router.health.penalties import PENALTY_FLOOR_MS, RegionPenalties, handshake_s
from router.health.stalls import StallWatch
from router.registry.collector import STALL_TOLERANCE_S  # one notion of "not running"
from router.registry.worker_view import WorkerView

log = logging.getLogger("globalpool.health")

# Failures that say the worker (or the path to it) is broken. BUSY is not one: a full
# engine is healthy, it only needs a moment (see `busy_until`).
_COUNTED = frozenset({Failure.CONNECT, Failure.SERVER_ERROR, Failure.TIMEOUT, Failure.RESET,
                      Failure.MID_STREAM, Failure.IDLE})
_SEVERE = frozenset({Failure.CONNECT, Failure.RESET})
BUSY_DEFAULT_S = 0.5
BUSY_MAX_S = 10.0
# How often waiting streams are checked for stalled workers (s).
STALL_CHECK_S = 0.25
# How often the streams waiting for their first byte are checked for overruns (s): see
# RegionPenalties.overdue. Each check visits only those streams (~1 us each).
OVERDUE_CHECK_S = 0.05
# A check that runs later than due by more than this judges nothing (s): the loop was
# held meanwhile, so first bytes may have come and not been read yet.
OVERDUE_LATE_S = 0.02
# Overruns judged by the last on-time check stand through late ones for so long (s): a
# busy loop's late checks must not wipe out what is known (traffic went back to a region
# still slow whenever one check ran late).
OVERDUE_KEEP_S = 0.25
# How often what passive health remembers is pruned (s): see Health.prune.
PRUNE_EVERY_S = 5.0


@dataclass(frozen=True, slots=True)
class HealthEvent:
    """A recent ejection or readmission, for the status page and logs."""

    at_s: float
    worker_id: str
    region: str
    kind: str  # "ejected" | "readmitted" | "region_ejected"
    detail: str


class Health:
    def __init__(
        self,
        policy: BreakerPolicy | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        latency_half_life_s: float = 10.0,
        region_eject_fraction: float = 0.5,
        stall_after_s: float = 3.0,
        stall_factor: float = 10.0,
        views: Callable[[], Mapping[str, WorkerView]] = dict,
    ) -> None:
        self._policy = policy or BreakerPolicy()
        self._clock = clock
        self._breakers: dict[str, Breaker] = {}
        self._busy_until_s: dict[str, float] = {}
        self._penalties = RegionPenalties(latency_half_life_s, self._workers_per_region)
        self.loop_lag = LoopLag(clock)  # the router's own delays (watch_loop_lag)
        self._counted_views: Mapping[str, WorkerView] | None = None
        self._region_counts: dict[str, int] = {}
        self._region_fraction = region_eject_fraction
        self._views = views  # the current snapshot's workers, for their own reports
        self._stalls = StallWatch(stall_after_s=stall_after_s, stall_factor=stall_factor,
                                  views=views)
        self.events: deque[HealthEvent] = deque(maxlen=100)
        # worker -> how far its streams waiting now have overrun their predictions beyond
        # its region's penalty (ms): the policy adds it to the worker's prediction (see
        # check_overdue); empty (the usual case) when nothing is late.
        self.overdue_ms: dict[str, float] = {}
        self._overdue_at_s = -1e18
        self.ejections_total = 0

    # --- the filter -------------------------------------------------------------------
    @property
    def quiet(self) -> bool:
        """Nothing has failed or refused lately: `filter` passes every candidate."""
        return not self._breakers and not self._busy_until_s

    def filter(self, candidates: list[WorkerView], now_s: float) -> list[WorkerView]:
        """Candidates whose breaker admits a request, minus ejected regions; never empty."""
        breakers = self._breakers
        busy = self._busy_until_s
        if not breakers and not busy:
            return candidates  # the common case: nothing has failed
        admitted: list[WorkerView] = []
        ejected_by_region: dict[str, int] = {}
        total_by_region: dict[str, int] = {}
        for view in candidates:
            region = view.region
            total_by_region[region] = total_by_region.get(region, 0) + 1
            breaker = breakers.get(view.worker_id)
            if breaker is not None and not breaker.admits(now_s):
                if breaker.state is BreakerState.OPEN:
                    ejected_by_region[region] = ejected_by_region.get(region, 0) + 1
                continue
            if busy and busy.get(view.worker_id, 0.0) > now_s:
                continue
            admitted.append(view)
        if ejected_by_region:
            failing = {region for region, ejected in ejected_by_region.items()
                       if ejected > self._region_fraction * total_by_region[region]}
            if failing:
                rest = [view for view in admitted if view.region not in failing]
                admitted = rest or admitted
        return admitted or candidates

    def region_penalty_ms(self, region: str, now_s: float) -> float:
        """How much slower than predicted this region's first bytes have been lately,
        beyond the other regions' (ms, >= 0): RegionPenalties.penalty_ms."""
        return self._penalties.penalty_ms(region, now_s)

    def region_penalties(self, now_s: float) -> dict[str, float]:
        """Every region's `region_penalty_ms` now, for operators (/metrics, /admin/status):
        why this router may prefer a farther region than heartbeats and RTTs alone say."""
        return self._penalties.all(now_s)

    def state_of(self, worker_id: str) -> BreakerState:
        """The worker's breaker as the status page and metrics show it: an open one whose
        backoff has run out is half-open (its next request is the probe), although the
        breaker itself turns so only when a request asks (Breaker.admits): on a router
        with no traffic for the worker it would otherwise read `ejected` indefinitely."""
        breaker = self._breakers.get(worker_id)
        if breaker is None:
            return BreakerState.CLOSED
        if breaker.state is BreakerState.OPEN and self._clock() >= breaker.open_until_s:
            return BreakerState.HALF_OPEN
        return breaker.state

    # --- the proxy's calls ------------------------------------------------------------
    def dispatched(self, attempt: Attempt) -> None:
        breaker = self._breakers.get(attempt.worker_id)
        if breaker is not None:
            breaker.dispatched()
        # Until its first byte (a non-streaming answer's first byte is its whole body):
        # see check_stalls.
        self._stalls.dispatched(attempt)
        self._penalties.dispatched(attempt)  # (a region traffic left: one stream at a time)

    def attempt_finished(self, attempt: Attempt) -> None:
        now_s = self._clock()
        self._stalls.finished(attempt)
        failure = attempt.failure
        if failure is None:
            if attempt.first_byte_s is None or attempt.client_gone or attempt.client_stalled:
                # No failure, but no whole answer either: its client left first (for a
                # non-streaming request, that cancels the wait; a stream it stopped
                # taking). Says nothing about the worker, and is no success: a half-open
                # probe of a hung worker, or of one whose streams never end, must not
                # readmit it, and a stream cut short by its client must not wipe out the
                # failures counted against a worker that breaks every stream it finishes.
                breaker = self._breakers.get(attempt.worker_id)
                if breaker is not None:
                    breaker.probe_abandoned()
                if attempt.first_byte_s is not None or attempt.outrun:
                    self._learn_latency(attempt, now_s)
                return
            breaker = self._breakers.get(attempt.worker_id)
            if breaker is not None:
                if breaker.succeeded(now_s):
                    self._event(now_s, attempt.worker_id, attempt.region, "readmitted",
                                "a request succeeded")
                if breaker.forgettable:
                    del self._breakers[attempt.worker_id]
            self._learn_latency(attempt, now_s)
            return
        if failure is Failure.BUSY:
            wait_s = min(BUSY_MAX_S, attempt.retry_after_s or BUSY_DEFAULT_S)
            self._busy_until_s[attempt.worker_id] = now_s + wait_s
            if len(self._busy_until_s) > 4096:
                self._busy_until_s = {w: t for w, t in self._busy_until_s.items() if t > now_s}
            return
        if failure in _COUNTED:
            breaker = self._breakers.get(attempt.worker_id)
            if breaker is None:
                breaker = self._breakers[attempt.worker_id] = Breaker(self._policy)
            if breaker.failed(now_s, severe=failure in _SEVERE):
                self.ejections_total += 1
                backoff = breaker.open_until_s - now_s
                self._event(now_s, attempt.worker_id, attempt.region, "ejected",
                            f"{failure.value}; back in {backoff:.1f} s")

    def request_finished(self, record: RequestRecord) -> None:
        return None

    def _learn_latency(self, attempt: Attempt, now_s: float) -> None:
        """The region penalties learn from `attempt` what the router's own lag and the
        worker's own report (its engine's recent TTFT) do not explain."""
        if not attempt.streamed:
            return
        view = self._views().get(attempt.worker_id)
        first_byte_s = attempt.first_byte_s
        if first_byte_s is None and attempt.outrun:
            # A hedged copy answered first: this one waited so long at least (a lower
            # bound, else a slow region whose copies are always outrun is never learnt).
            first_byte_s = attempt.finished_s
        delay_s = 0.0 if first_byte_s is None else min(
            self.loop_lag.around(first_byte_s), first_byte_s - attempt.started_s)
        self._penalties.learn(attempt, now_s, router_delay_s=delay_s,
                              engine_ttft_ms=None if view is None else view.ttft_ms,
                              ttfb_s=None if first_byte_s is None
                              else first_byte_s - attempt.started_s - handshake_s(attempt),
                              lower_bound=attempt.outrun)

    def _workers_per_region(self) -> dict[str, int]:
        """Workers per region in the current fleet view, counted once per view."""
        views = self._views()
        if views is not self._counted_views:
            counts: dict[str, int] = {}
            for view in views.values():
                counts[view.region] = counts.get(view.region, 0) + 1
            self._region_counts, self._counted_views = counts, views
        return self._region_counts

    @property
    def penalty_samples_skipped(self) -> int:
        """Streamed attempts not learnt from: this router's event loop ran late meanwhile."""
        return self._penalties.skipped_lagged

    async def watch_loop_lag(self) -> None:
        """Measure this process's event-loop lag until cancelled (LoopLag.watch)."""
        await self.loop_lag.watch()

    def reported_down(self, worker_id: str, region: str, detail: str) -> None:
        """The worker's own heartbeat says it stopped serving (ready -> degraded).

        Counted like a refused connection: it ejects, and the worker comes back only
        through the breaker (backoff, then one probe), so a worker that keeps crashing
        and restarting is kept out longer each time instead of being readmitted by its
        next `ready` heartbeat.
        """
        now_s = self._clock()
        breaker = self._breakers.get(worker_id)
        if breaker is None:
            breaker = self._breakers[worker_id] = Breaker(self._policy)
        if breaker.failed(now_s, severe=True, went_down=True):
            self.ejections_total += 1
            backoff = breaker.open_until_s - now_s
            self._event(now_s, worker_id, region, "ejected",
                        f"heartbeat: {detail}; back in {backoff:.1f} s")

    # --- stalls: a worker that answers nobody while the others answer -------------------
    def check_stalls(self) -> list[str]:
        """Find workers that have stopped answering (StallWatch.find says how); eject them
        and abandon the attempts waiting on them that can go to another worker now
        (Attempt.elsewhere: retried there; nothing has reached their clients yet). The
        others keep waiting, and go once a later check finds somewhere (or fail once
        they have waited `stall_factor` x `stall_after_s`): a worker found stalled may
        only be slow (an engine starved of CPU reports stale counts), and its answer
        late beats an error now.

        A hung worker so shows within `stall_after_s` whatever the kind of request, not
        after `timeouts.first_byte_s` or `total_s` (which must stay long enough for the
        longest legitimate queue and generation). Returns the workers found stalled now.
        """
        now_s = self._clock()
        stalled: list[str] = []
        for stall in self._stalls.find(now_s):
            worker_id = stall.worker_id
            stalled.append(worker_id)
            breaker = self._breakers.get(worker_id)
            if breaker is None:
                breaker = self._breakers[worker_id] = Breaker(self._policy)
            # Ejected first (no retry goes back there); once while out (kept attempts show
            # the stall at every check), again for longer once its backoff has run out.
            breaker.admits(now_s)
            ejected = breaker.state is BreakerState.OPEN
            if not ejected and breaker.failed(now_s, severe=True):
                self.ejections_total += 1
            kept, abandoned = self._stalls.release(stall, now_s)
            if ejected and not abandoned:
                continue  # said already
            detail = stall.detail
            if not ejected:
                detail += f"; back in {breaker.open_until_s - now_s:.1f} s"
            if kept:
                detail += f"; {kept} kept waiting there: no other worker can take them"
            self._event(now_s, worker_id, stall.region, "ejected", detail)
        for (worker_id, region), (cut, stuck_s) in self._stalls.cut_stuck_streams(now_s).items():
            self._event(now_s, worker_id, region, "streams cut", f"{cut} silent stream(s) "
                        f"cut, to go on elsewhere: its agent reports no step for {stuck_s:.0f} s")
        return stalled

    def check_overdue(self, *, late: bool = False) -> None:
        """Judge how far the streams still waiting for their first byte have overrun what
        their path and engine explain: each region's penalty counts its workers' overruns
        (RegionPenalties.overdue: several workers' evidence, as for what is learnt), and a
        worker's own overrun beyond that penalty is added to its prediction
        (`overdue_ms`): its new requests go to a sibling that answers as predicted, and
        the region is avoided once that one is late too.

        `late`: this check itself ran late, so first bytes that came meanwhile may not
        have been read yet: nothing new is judged, and the last judgement stands for up
        to OVERDUE_KEEP_S."""
        now_s = self._clock()
        if late:
            if now_s - self._overdue_at_s > OVERDUE_KEEP_S:
                self._forget_overdue(now_s)
            return
        views = self._views()
        waiting: list[tuple[Attempt, float, float | None]] = []
        for attempt, waited_s in self._stalls.waiting_streams(now_s):
            view = views.get(attempt.worker_id)
            waiting.append((attempt, waited_s - handshake_s(attempt),
                            None if view is None else view.ttft_ms))
        overruns = self._penalties.overdue(waiting, now_s)
        self._overdue_at_s = now_s
        own: dict[str, float] = {}
        if overruns:
            # Beyond what every region misses by lately (nobody's path: a worker with
            # streams in flight must not look slower than an idle one for it) and beyond
            # its region's penalty.
            usual_ms = self._penalties.usual_ms(now_s) + PENALTY_FLOOR_MS
            for region, workers in overruns.items():
                penalty_ms = self._penalties.penalty_ms(region, now_s)
                for worker_id, overrun_ms in workers.items():
                    beyond_ms = overrun_ms - usual_ms - penalty_ms
                    if beyond_ms > 0.0:
                        own[worker_id] = beyond_ms
        if own or self.overdue_ms:
            self.overdue_ms = own

    def _forget_overdue(self, now_s: float) -> None:
        """No stream counts as overdue any more (none waits, or the last judgement is
        too old to stand)."""
        if self.overdue_ms or self._penalties.overdue_pending:
            self._penalties.overdue([], now_s)
            self.overdue_ms = {}

    async def watch_stalls(self, interval_s: float = STALL_CHECK_S,
                           overdue_s: float = OVERDUE_CHECK_S) -> None:
        """Run `check_overdue` every `overdue_s` and `check_stalls` every `interval_s`
        until cancelled. Time this process was not running (its host stalled) does not
        count as waiting: nobody could answer."""
        loop = asyncio.get_running_loop()
        next_prune_s = loop.time() + PRUNE_EVERY_S
        next_stall_check_s = loop.time() + interval_s
        while True:
            before = loop.time()
            await asyncio.sleep(overdue_s)
            overslept_s = loop.time() - before - overdue_s
            if overslept_s > STALL_TOLERANCE_S:
                self._stalls.paused(overslept_s)
            stall_check_due = loop.time() >= next_stall_check_s
            if stall_check_due:
                next_stall_check_s = loop.time() + interval_s
            if self._stalls.waiting:
                self.check_overdue(late=overslept_s > OVERDUE_LATE_S)
                if stall_check_due:
                    self.check_stalls()
            else:
                self._forget_overdue(self._clock())
                if stall_check_due and self._stalls.under_way:  # (streams a stuck engine holds)
                    self.check_stalls()
            if loop.time() >= next_prune_s:
                self.prune()
                next_prune_s = loop.time() + PRUNE_EVERY_S

    def prune(self) -> None:
        """Forget what no longer matters, so that nothing here grows with the fleet's
        churn or with time: first bytes older than every waiting attempt (the stall check
        only compares answers with attempts sent before them), busy marks that have run
        out, and breakers of workers that have left the fleet view and whose ejection is
        over (a breaker left behind would keep `quiet` false: every routing decision
        would take the slower path)."""
        now_s = self._clock()
        self._stalls.prune(now_s)
        self._busy_until_s = {w: t for w, t in self._busy_until_s.items() if t > now_s}
        views = self._views()
        if views:
            gone = [worker for worker, breaker in self._breakers.items()
                    if worker not in views and breaker.open_until_s <= now_s]
            for worker in gone:
                del self._breakers[worker]

    def _event(self, now_s: float, worker_id: str, region: str, kind: str, detail: str) -> None:
        self.events.append(HealthEvent(now_s, worker_id, region, kind, detail))
        log.warning("worker %s (%s) %s: %s", worker_id, region, kind, detail)

