"""GCRA (the generic cell rate algorithm): a leaky bucket kept as one timestamp per limit.

A limit of `limit` units per minute with a burst of `burst` units is an emission interval
`T = 60 s / limit` and a capacity of `burst * T`. The state is the theoretical arrival
time `tat`: the moment the bucket would be empty again. A request costing `n` units fits
when `max(tat, now) + n*T - capacity <= now`; then `tat` moves to `max(tat, now) + n*T`.

    remaining units = floor((capacity - (tat - now)) / T)
    reset           = tat - now           (until the bucket is entirely refilled)
    retry after     = max(tat, now) + n*T - capacity - now   (when it would fit)

The same arithmetic runs in Redis (the Lua script in `redis_limiter`, global across
router replicas) and here (`LocalLimiter`, while Redis is unreachable). Times are
microseconds.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

US_PER_MIN = 60_000_000


# The per-request objects below are plain (not frozen) slotted dataclasses: several are
# made per request, and a frozen dataclass costs about five times as much to build.
# Treat them as immutable.


@dataclass(slots=True)
class Bucket:
    """One limit that a request is charged against.

    `name` identifies the bucket across replicas (it is the Redis key's suffix);
    `scope` is "key" or "tenant" and `unit` "requests" or "tokens" (for headers, counters).
    """

    name: str
    scope: str
    unit: str
    limit_per_min: int
    burst: int
    cost: int
    interval_us: float = 0.0  # set from limit_per_min
    capacity_us: float = 0.0  # set from burst

    def __post_init__(self) -> None:
        self.interval_us = US_PER_MIN / self.limit_per_min
        self.capacity_us = self.burst * self.interval_us

    @property
    def fits_at_all(self) -> bool:
        """False when the cost exceeds the burst: no amount of waiting lets it through."""
        return self.cost <= self.burst


@dataclass(slots=True)
class BucketState:
    """A bucket after a decision: what the `x-ratelimit-*` headers report."""

    bucket: Bucket
    remaining: int
    reset_s: float
    retry_after_s: float  # 0 when this bucket had room


@dataclass(slots=True)
class RateDecision:
    """All buckets of one request, decided together: either all are charged or none."""

    allowed: bool
    states: tuple[BucketState, ...]
    source: str  # "redis" | "local"

    @property
    def retry_after_s(self) -> float:
        return max((s.retry_after_s for s in self.states), default=0.0)

    @property
    def too_large(self) -> tuple[BucketState, ...]:
        return tuple(s for s in self.states if not s.bucket.fits_at_all)


def state_after(bucket: Bucket, ahead_us: float, retry_after_us: float) -> BucketState:
    """The reportable state of `bucket` whose `tat` is `ahead_us` past now."""
    ahead_us = max(0.0, ahead_us)
    remaining = math.floor((bucket.capacity_us - ahead_us) / bucket.interval_us + 1e-9)
    return BucketState(bucket=bucket, remaining=max(0, min(bucket.burst, remaining)),
                       reset_s=ahead_us / 1e6, retry_after_s=max(0.0, retry_after_us) / 1e6)


class LocalLimiter:
    """GCRA buckets in this process: the fallback while Redis is unreachable.

    Each replica enforces the full limit on its own, so during an outage N replicas admit
    at most N times the limit. While Redis answers, `sync` copies the global state in, so
    the fallback starts from what was already used instead of from a full bucket. The
    table holds one float per tenant and configured bucket that has been used: it is
    bounded by the configuration (its tenants), not by traffic.
    """

    __slots__ = ("_clock", "_tat_us")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        # (tenant, bucket name) -> its theoretical arrival time (a bucket's name, such as
        # "tenant:requests", is the same for every tenant)
        self._tat_us: dict[tuple[str, str], float] = {}

    def _now_us(self) -> float:
        return self._clock() * 1e6

    def check(self, tenant: str, buckets: Sequence[Bucket]) -> RateDecision:
        """Admit one request of `tenant` against its `buckets`, or refuse it."""
        now = self._now_us()
        tats = self._tat_us
        planned: list[tuple[Bucket, float, float]] = []  # bucket, base tat, new tat
        allowed = True
        for bucket in buckets:
            base = max(tats.get((tenant, bucket.name), now), now)
            new_tat = base + bucket.cost * bucket.interval_us
            if new_tat - bucket.capacity_us > now or not bucket.fits_at_all:
                allowed = False
            planned.append((bucket, base, new_tat))
        states: list[BucketState] = []
        for bucket, base, new_tat in planned:
            if allowed:
                tats[tenant, bucket.name] = new_tat
                states.append(state_after(bucket, new_tat - now, 0.0))
            else:
                wait = new_tat - bucket.capacity_us - now
                states.append(state_after(bucket, base - now, wait))
        return RateDecision(allowed=allowed, states=tuple(states), source="local")

    def sync(self, tenant: str, bucket: Bucket, ahead_us: float) -> None:
        """Adopt the global state of `tenant`'s `bucket` (its `tat` is `ahead_us` past
        now)."""
        self._tat_us[tenant, bucket.name] = self._now_us() + max(0.0, ahead_us)
