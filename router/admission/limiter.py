"""Rate limits on the request path: Redis when it answers quickly, this process otherwise.

The request path never waits long on Redis: each check is bounded by `redis_timeout_ms`
(75 ms by default). On a timeout or error the local limiter decides, and Redis is not
asked again for `redis_retry_s`, so during an outage requests pay nothing for it; then
one request tries again. Every Redis answer is copied into the local limiter, so a
fallback starts from the global state instead of a full bucket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence

from redis.exceptions import RedisError

from router.admission.gcra import Bucket, LocalLimiter, RateDecision
from router.admission.redis_limiter import RedisLimiter
from router.core.stats import SecurityStats
from worker.redis_client import raise_if_cancelling

log = logging.getLogger("globalpool.admission")


class RateLimiter:
    """`check(tenant, buckets)`: all-or-nothing over the buckets; never raises for Redis."""

    def __init__(
        self,
        redis: RedisLimiter | None,
        *,
        stats: SecurityStats,
        timeout_s: float = 0.075,
        retry_s: float = 1.0,
        local: LocalLimiter | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._redis = redis
        self._stats = stats
        self._timeout_s = timeout_s
        self._retry_s = retry_s
        self._local = local or LocalLimiter(clock)
        self._clock = clock
        self._redis_down_until = 0.0
        self._redis_down = False

    async def warm_up(self, timeout_s: float = 1.0) -> None:
        """Connect to Redis ahead of the first request; errors are left to `check`."""
        if self._redis is None:
            return
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._redis.warm_up()

    async def aclose(self) -> None:
        """Close the Redis client (the local limiter needs no cleanup)."""
        if self._redis is not None:
            await self._redis.aclose()

    @property
    def using_redis(self) -> bool:
        """False while the local fallback is in charge."""
        return self._redis is not None and not self._redis_down

    async def check(self, tenant: str, buckets: Sequence[Bucket]) -> RateDecision:
        if self._redis is not None and self._clock() >= self._redis_down_until:
            try:
                async with asyncio.timeout(self._timeout_s):
                    decision = await self._redis.check(tenant, buckets)
            except (RedisError, OSError, TimeoutError) as exc:
                raise_if_cancelling()
                self._on_redis_failure(exc)
            else:
                self._on_redis_ok()
                for state in decision.states:
                    self._local.sync(tenant, state.bucket, state.reset_s * 1e6)
                self._stats.rate_limit_source["redis"] += 1
                return decision
        self._stats.rate_limit_source["local"] += 1
        return self._local.check(tenant, buckets)

    def _on_redis_failure(self, exc: BaseException) -> None:
        self._stats.rate_limit_redis_errors += 1
        self._redis_down_until = self._clock() + self._retry_s
        if not self._redis_down:
            self._redis_down = True
            log.warning("rate limits: redis did not answer within %.0f ms (%s); this replica "
                        "enforces the limits on its own until it does",
                        self._timeout_s * 1000, type(exc).__name__)

    def _on_redis_ok(self) -> None:
        if self._redis_down:
            self._redis_down = False
            log.warning("rate limits: redis answers again; limits are global again")
