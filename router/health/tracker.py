"""Passive health: learn from every attempt's outcome, filter candidates before scoring.

One `Health` per router. It is an observer of attempts (see router.proxy.outcome) and
the health filter that `Policy.pick` applies for every policy. It never empties the
candidate set: if every candidate is ejected it fails open and returns them all, because
an attempt that might succeed beats a certain 503 (the ejection cap).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from router.health.breaker import Breaker, BreakerPolicy, BreakerState
from router.proxy.outcome import Attempt, Failure, RequestRecord
from router.registry.snapshot import WorkerView

log = logging.getLogger("globalpool.health")

# Failures that say the worker (or the path to it) is broken. BUSY is not one: a full
# engine is healthy, it only needs a moment (see `busy_until`).
_COUNTED = frozenset({Failure.CONNECT, Failure.SERVER_ERROR, Failure.TIMEOUT, Failure.RESET,
                      Failure.MID_STREAM, Failure.IDLE})
_SEVERE = frozenset({Failure.CONNECT, Failure.RESET})
BUSY_DEFAULT_S = 0.5
BUSY_MAX_S = 10.0


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
    ) -> None:
        self._policy = policy or BreakerPolicy()
        self._clock = clock
        self._breakers: dict[str, Breaker] = {}
        self._busy_until_s: dict[str, float] = {}
        self._excess_ms: dict[str, tuple[float, float]] = {}  # region -> (ewma, at_s)
        self._baseline_ms = 0.0  # the smallest regional excess, as of the last sample
        self._half_life_s = latency_half_life_s
        self._region_fraction = region_eject_fraction
        self.events: deque[HealthEvent] = deque(maxlen=100)
        self.ejections_total = 0

    # --- the filter -------------------------------------------------------------------
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
        beyond the least-surprising region's (ms, >= 0).

        Relative, because every prediction misses some constant (engine scheduling,
        this machine's load): only a region slower than the others should be avoided,
        and a region with no samples yet is not thereby made to look better.
        """
        entry = self._excess_ms.get(region)
        if entry is None:
            return 0.0
        ewma, at_s = entry
        decay: float = 0.5 ** ((now_s - at_s) / self._half_life_s)
        return max(0.0, ewma * decay - self._baseline_ms)

    def state_of(self, worker_id: str) -> BreakerState:
        breaker = self._breakers.get(worker_id)
        return BreakerState.CLOSED if breaker is None else breaker.state

    # --- the proxy's calls ------------------------------------------------------------
    def dispatched(self, worker_id: str) -> None:
        breaker = self._breakers.get(worker_id)
        if breaker is not None:
            breaker.dispatched()

    def attempt_finished(self, attempt: Attempt) -> None:
        now_s = self._clock()
        failure = attempt.failure
        if failure is None:
            if attempt.client_gone and attempt.first_byte_s is None:
                return  # says nothing about the worker
            breaker = self._breakers.get(attempt.worker_id)
            if breaker is not None:
                if breaker.succeeded():
                    self._event(now_s, attempt, "readmitted", "a request succeeded")
                if breaker.consecutive_failures == 0 and breaker.state is BreakerState.CLOSED:
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
                self._event(now_s, attempt, "ejected", f"{failure.value}; back in {backoff:.1f} s")

    def request_finished(self, record: RequestRecord) -> None:
        return None

    def _learn_latency(self, attempt: Attempt, now_s: float) -> None:
        ttfb_s = attempt.ttfb_s
        if ttfb_s is None or not attempt.streamed:
            return  # a non-streaming answer's first byte is its last: not a TTFT
        excess = ttfb_s * 1000.0 - attempt.predicted_ttft_ms
        previous = self._excess_ms.get(attempt.region)
        ewma = excess if previous is None else (
            0.8 * previous[0] * 0.5 ** ((now_s - previous[1]) / self._half_life_s) + 0.2 * excess)
        self._excess_ms[attempt.region] = (ewma, now_s)
        self._baseline_ms = min(
            value * 0.5 ** ((now_s - at_s) / self._half_life_s)
            for value, at_s in self._excess_ms.values()
        )

    def _event(self, now_s: float, attempt: Attempt, kind: str, detail: str) -> None:
        self.events.append(HealthEvent(now_s, attempt.worker_id, attempt.region, kind, detail))
        log.warning("worker %s (%s) %s: %s", attempt.worker_id, attempt.region, kind, detail)

