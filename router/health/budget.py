"""A retry budget: retries may add at most `ratio` extra load (plus a small floor).

Without one, a failing region turns every request into `max_attempts` requests and the
retries themselves overload the healthy regions (a retry storm). Tokens accrue per
request (`ratio` each, so 0.2 = one retry per five requests) and from a floor of
`min_per_s` per second so that a quiet router can still retry; a retry spends one.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class RetryBudget:
    __slots__ = ("_cap", "_clock", "_last_s", "_min_per_s", "_ratio", "_tokens", "denied")

    def __init__(
        self,
        ratio: float = 0.2,
        *,
        min_per_s: float = 5.0,
        cap: float = 50.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ratio = ratio
        self._min_per_s = min_per_s
        self._cap = cap
        self._clock = clock
        self._tokens = cap / 5
        self._last_s = clock()
        self.denied = 0

    def request_arrived(self) -> None:
        self._tokens = min(self._cap, self._tokens + self._ratio)

    def try_spend(self) -> bool:
        now_s = self._clock()
        self._tokens = min(self._cap, self._tokens + (now_s - self._last_s) * self._min_per_s)
        self._last_s = now_s
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        self.denied += 1
        return False
