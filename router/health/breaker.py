"""A circuit breaker per worker, driven only by this router's own observations.

    closed --(failures)--> open --(backoff elapses)--> half-open --(probe ok)--> closed
                             ^                              |
                             +-------(probe fails: longer backoff)

A connection refused or reset ejects at once (the process is gone or going); other
failures (5xx, timeouts, broken streams) eject after `failures_to_eject` in a row. Each
ejection doubles the backoff, up to `max_backoff_s`. A readmission does not forget the
ejections: only `stable_after_s` of staying admitted does, and failing again within that
time quadruples the backoff, so a flapping worker (killed again soon after every
comeback) stays out 1, 4, 16 s... instead of 1 s every time.
In half-open exactly one request (the probe) is let through; the rest wait for its result.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class BreakerPolicy:
    failures_to_eject: int = 3
    base_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    stable_after_s: float = 30.0  # admitted this long: earlier ejections are forgotten


class Breaker:
    """The state of one worker. All times are monotonic seconds passed in by the caller."""

    __slots__ = ("_policy", "closed_at_s", "consecutive_failures", "ejections",
                 "open_until_s", "probe_in_flight", "state")

    def __init__(self, policy: BreakerPolicy) -> None:
        self._policy = policy
        self.state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self.ejections = 0  # recent ejections, for the backoff
        self.open_until_s = 0.0
        self.closed_at_s = 0.0  # when it was last readmitted
        self.probe_in_flight = False

    def admits(self, now_s: float) -> bool:
        """Whether a new request may go to this worker now (without taking the probe slot)."""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN and now_s >= self.open_until_s:
            self.state = BreakerState.HALF_OPEN
            self.probe_in_flight = False
        return self.state is BreakerState.HALF_OPEN and not self.probe_in_flight

    def dispatched(self) -> None:
        """A request was sent; in half-open it is the probe."""
        if self.state is BreakerState.HALF_OPEN:
            self.probe_in_flight = True

    def probe_abandoned(self) -> None:
        """The request in flight ended with no verdict (its client left): in half-open,
        the next request is the probe."""
        if self.state is BreakerState.HALF_OPEN:
            self.probe_in_flight = False

    def succeeded(self, now_s: float) -> bool:
        """Returns True if this success readmitted an ejected worker."""
        readmitted = self.state is not BreakerState.CLOSED
        if readmitted:
            self.state = BreakerState.CLOSED
            self.closed_at_s = now_s
        elif self.ejections and now_s - self.closed_at_s >= self._policy.stable_after_s:
            self.ejections = 0
        self.consecutive_failures = 0
        self.probe_in_flight = False
        return readmitted

    @property
    def forgettable(self) -> bool:
        """Closed with nothing to remember: the caller may drop this breaker."""
        return (self.state is BreakerState.CLOSED and self.consecutive_failures == 0
                and self.ejections == 0)

    def failed(self, now_s: float, *, severe: bool, went_down: bool = False) -> bool:
        """Count a failure; returns True if it ejected the worker.

        `went_down`: the worker itself says it stopped (its heartbeat turned `degraded`).
        That ejects even an ejected worker again, for longer: it is still failing while
        out. Failures of requests sent before an ejection do not (one crash breaks
        several at once).
        """
        self.consecutive_failures += 1
        self.probe_in_flight = False
        if self.state is BreakerState.OPEN:
            if not went_down:
                return False
        else:
            threshold = 1 if severe or self.state is BreakerState.HALF_OPEN else (
                self._policy.failures_to_eject)
            if self.consecutive_failures < threshold:
                return False
        # Failing again soon after a readmission is flapping: the backoff quadruples.
        relapsed = (self.ejections > 0 and self.state is BreakerState.CLOSED
                    and now_s - self.closed_at_s < self._policy.stable_after_s)
        self.ejections += 2 if relapsed else 1
        backoff = min(self._policy.max_backoff_s,
                      self._policy.base_backoff_s * 2 ** (self.ejections - 1))
        self.state = BreakerState.OPEN
        self.open_until_s = now_s + backoff
        return True
