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
# A region's first bytes must miss their predictions by this much more than the other
# regions' before it is penalised (ms): smaller misses are scheduling noise.
PENALTY_FLOOR_MS = 25.0
# Penalties are recomputed at most this often (s), or after a new sample.
PENALTY_REFRESH_S = 0.05
# How often waiting streams are checked for stalled workers (s).
STALL_CHECK_S = 0.25
# A heartbeat received this long after a request was sent should count it (s).
HEARTBEAT_SLACK_S = 0.5
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
        self._excess_ms: dict[str, tuple[float, float]] = {}  # region -> (ewma, at_s)
        self._penalties: dict[str, float] = {}  # region -> penalty, as of _penalties_at_s
        self._penalties_at_s = -1e18
        self._half_life_s = latency_half_life_s
        self._region_fraction = region_eject_fraction
        self._stall_after_s = stall_after_s
        self._stall_factor = stall_factor
        self._views = views  # the current snapshot's workers, for their own reports
        self._awaiting: dict[int, Attempt] = {}  # attempts before their first byte
        # Answers on their way (Attempt.answering): the read count last seen, and when.
        self._silence: dict[int, tuple[int, float]] = {}
        self._paused_s: dict[int, float] = {}  # waiting time the router was not running
        self._last_first_byte_s: dict[str, float] = {}
        self._last_any_first_byte_s = -1e18
        self.events: deque[HealthEvent] = deque(maxlen=100)
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
        beyond the other regions' (ms, >= 0).

        Every prediction misses some constant (engine scheduling, this machine's load),
        so a region is compared with the least-surprising *other* region; a region this
        router has no recent samples from counts as "as predicted" (0 ms). A region that
        carries all the traffic is thus judged against the prediction itself, not against
        itself, and misses below `PENALTY_FLOOR_MS` are treated as noise.
        """
        entry = self._excess_ms.get(region)
        if entry is None:
            return 0.0
        if now_s - self._penalties_at_s > PENALTY_REFRESH_S or now_s < self._penalties_at_s:
            self._refresh_penalties(now_s)
        return self._penalties.get(region, 0.0)

    def region_penalties(self, now_s: float) -> dict[str, float]:
        """Every region's `region_penalty_ms` now, for operators (/metrics, /admin/status):
        why this router may prefer a farther region than heartbeats and RTTs alone say."""
        if not self._excess_ms:
            return {}
        self._refresh_penalties(now_s)
        return dict(self._penalties)

    def _refresh_penalties(self, now_s: float) -> None:
        half_life_s = self._half_life_s
        current = {region: ewma * 0.5 ** ((now_s - at_s) / half_life_s)
                   for region, (ewma, at_s) in self._excess_ms.items()}
        penalties: dict[str, float] = {}
        for region, excess in current.items():
            others = [value for other, value in current.items() if other != region]
            baseline = min(others) if others else 0.0
            penalties[region] = max(0.0, excess - max(0.0, baseline) - PENALTY_FLOOR_MS)
        self._penalties = penalties
        self._penalties_at_s = now_s

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
        self._awaiting[id(attempt)] = attempt

    def attempt_finished(self, attempt: Attempt) -> None:
        now_s = self._clock()
        if self._awaiting.pop(id(attempt), None) is not None:
            self._saw_first_byte(attempt)
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
                if attempt.first_byte_s is not None:
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
        """Find workers that have stopped answering; eject them and abandon the attempts
        waiting on them (retried elsewhere: nothing has reached their clients yet).

        Each attempt waits for its first byte (a non-streaming answer's first byte is its
        whole body). A worker is stalled when an attempt there has waited `stall_after_s`
        (streams: also `stall_factor` x their predicted TTFT), the worker has answered
        nothing since that attempt was sent, and there is evidence that the fault is the
        worker's:
        - for a stream, other workers delivered first bytes meanwhile;
        - for any attempt that has received nothing for `stall_after_s` (a long
          generation is not silence: its engine counts it), the worker's own heartbeat,
          taken after those requests were sent, counts fewer sequences than this router
          has waiting there (they never reached its engine: a hung API server, a
          partition of the data path), or the worker has left the fleet view (its
          heartbeats stopped; the view drops a worker only while Redis answers, so an
          outage of Redis is not taken for one). A non-streaming answer whose head came
          `stall_after_s` ago and whose body has not ended counts as silent too (an
          engine writes a whole answer at once: a body that never ends).
        A hung worker so shows within `stall_after_s` whatever the kind of request, not
        after `timeouts.first_byte_s` or `total_s` (which must stay long enough for the
        longest legitimate queue and generation). Returns the workers found stalled now.
        """
        now_s = self._clock()
        # Only attempts sent `stall_after_s` ago or earlier can show a stall (every rule
        # needs that long a wait): the usual check, with every request young, stops here.
        sent_before_s = now_s - self._stall_after_s
        waiting: dict[str, list[Attempt]] = {}
        for key, attempt in list(self._awaiting.items()):
            if attempt.first_byte_s is not None:
                del self._awaiting[key]
                self._saw_first_byte(attempt)
            elif attempt.started_s <= sent_before_s:
                waiting.setdefault(attempt.worker_id, []).append(attempt)
        if self._silence:
            for key in [key for key in self._silence if key not in self._awaiting]:
                del self._silence[key]
        if not waiting:
            return []
        views = self._views()
        stalled: list[str] = []
        for worker_id, old in waiting.items():
            found = self._stall_evidence(worker_id, old, views, now_s)
            if found is None:
                continue
            evidence, oldest = found
            stalled.append(worker_id)
            attempts = [a for a in self._awaiting.values() if a.worker_id == worker_id]
            waited_s = self._waited_s(oldest, now_s)
            detail = (f"stalled: no answer for {waited_s:.1f} s ({len(attempts)} "
                      f"waiting) {evidence}")
            breaker = self._breakers.get(worker_id)
            if breaker is None:
                breaker = self._breakers[worker_id] = Breaker(self._policy)
            if breaker.failed(now_s, severe=True):
                self.ejections_total += 1
                detail += f"; back in {breaker.open_until_s - now_s:.1f} s"
            self._event(now_s, worker_id, oldest.region, "ejected", detail)
            for attempt in attempts:
                attempt.abandon(f"worker {worker_id} stalled")
        return stalled

    def _stall_evidence(self, worker_id: str, attempts: list[Attempt],
                        views: Mapping[str, WorkerView], now_s: float
                        ) -> tuple[str, Attempt] | None:
        """(why, the attempt that shows it) if `worker_id` is stalled (see check_stalls)."""
        answered_s = self._last_first_byte_s.get(worker_id, -1e18)
        streams = [a for a in attempts if a.streamed and a.started_s > answered_s]
        if streams:
            oldest = min(streams, key=_started)
            limit_s = max(self._stall_after_s,
                          self._stall_factor * oldest.predicted_ttft_ms / 1000)
            if (self._waited_s(oldest, now_s) >= limit_s
                    and self._last_any_first_byte_s > oldest.started_s):
                return "while other workers answer", oldest
        # An unending whole answer counts whatever else the worker answered meanwhile (a
        # worker whose streams start well may still never finish a body).
        silent = [a for a in attempts if self._waited_s(a, now_s) >= self._stall_after_s
                  and (self._unending(a, now_s)
                       or (a.started_s > answered_s
                           and self._silent_s(a, now_s) >= self._stall_after_s))]
        if not silent:
            return None
        oldest = min(silent, key=_started)
        view = views.get(worker_id)
        if view is None:
            # Out of the fleet view: its heartbeats stopped or it said it is gone. (An
            # empty view says nothing: the router has not read the fleet yet.)
            return ("after its heartbeats stopped", oldest) if views else None
        sent_before = sum(1 for a in silent if a.started_s + HEARTBEAT_SLACK_S < view.received_at_s)
        if sent_before == 0 or view.reported_load >= sent_before:
            return None
        return (f"while its heartbeat counts {view.reported_load} sequences of the "
                f"{sent_before} sent there before it"), oldest

    def _waited_s(self, attempt: Attempt, now_s: float) -> float:
        """How long `attempt` has waited, less the time this process was not running."""
        return now_s - attempt.started_s - self._paused_s.get(id(attempt), 0.0)

    def _unending(self, attempt: Attempt, now_s: float) -> bool:
        """A non-streaming answer whose head came `stall_after_s` ago and whose body has
        not ended: an engine writes a whole answer at once, when generation is done (a
        body that never ends, or trickles). With the heartbeat evidence (the engine no
        longer counts the request) it is a stall, however the body still moves."""
        head = attempt.answer_head
        return head is not None and now_s - head[1] >= self._stall_after_s

    def _silent_s(self, attempt: Attempt, now_s: float) -> float:
        """How long nothing has arrived for `attempt`: since it was sent, or since its
        answer's body last moved (a non-streaming answer on its way: `answering`)."""
        answering = attempt.answering
        if answering is None:
            return self._waited_s(attempt, now_s)
        key = id(attempt)
        reads = answering.reads
        seen = self._silence.get(key) or attempt.answer_head  # (silent since its head?)
        if seen is None or seen[0] != reads:
            self._silence[key] = (reads, now_s)
            return 0.0
        self._silence[key] = seen
        return now_s - seen[1]

    async def watch_stalls(self, interval_s: float = STALL_CHECK_S) -> None:
        """Run `check_stalls` every `interval_s` until cancelled. Time this process was not
        running (its host stalled) does not count as waiting: nobody could answer."""
        loop = asyncio.get_running_loop()
        next_prune_s = loop.time() + PRUNE_EVERY_S
        while True:
            before = loop.time()
            await asyncio.sleep(interval_s)
            overslept_s = loop.time() - before - interval_s
            if overslept_s > STALL_TOLERANCE_S:
                paused = self._paused_s
                self._paused_s = {key: paused.get(key, 0.0) + overslept_s
                                  for key in self._awaiting}
            if self._awaiting:
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
        oldest_s = min((a.started_s for a in self._awaiting.values()), default=now_s)
        self._last_first_byte_s = {worker: at_s for worker, at_s
                                   in self._last_first_byte_s.items() if at_s >= oldest_s}
        self._busy_until_s = {w: t for w, t in self._busy_until_s.items() if t > now_s}
        views = self._views()
        if views:
            gone = [worker for worker, breaker in self._breakers.items()
                    if worker not in views and breaker.open_until_s <= now_s]
            for worker in gone:
                del self._breakers[worker]

    def _saw_first_byte(self, attempt: Attempt) -> None:
        self._paused_s.pop(id(attempt), None)
        first_byte_s = attempt.first_byte_s
        if first_byte_s is None:
            return
        if first_byte_s > self._last_first_byte_s.get(attempt.worker_id, -1e18):
            self._last_first_byte_s[attempt.worker_id] = first_byte_s
        self._last_any_first_byte_s = max(self._last_any_first_byte_s, first_byte_s)

    def _learn_latency(self, attempt: Attempt, now_s: float) -> None:
        ttfb_s = attempt.ttfb_s
        if ttfb_s is None or not attempt.streamed:
            return  # a non-streaming answer's first byte is its last: not a TTFT
        excess = ttfb_s * 1000.0 - attempt.predicted_ttft_ms
        previous = self._excess_ms.get(attempt.region)
        ewma = excess if previous is None else (
            0.8 * previous[0] * 0.5 ** ((now_s - previous[1]) / self._half_life_s) + 0.2 * excess)
        self._excess_ms[attempt.region] = (ewma, now_s)
        self._penalties_at_s = -1e18  # recompute at the next question

    def _event(self, now_s: float, worker_id: str, region: str, kind: str, detail: str) -> None:
        self.events.append(HealthEvent(now_s, worker_id, region, kind, detail))
        log.warning("worker %s (%s) %s: %s", worker_id, region, kind, detail)


def _started(attempt: Attempt) -> float:
    return attempt.started_s
