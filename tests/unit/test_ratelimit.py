"""GCRA limits in this process, the headers they produce, and the fallback from Redis."""

from __future__ import annotations

import asyncio
import time

import pytest

from lab.devstack.valkey import free_port
from router.admission.gate import buckets_for, duration, rate_limit_headers
from router.admission.gcra import Bucket, LocalLimiter
from router.admission.limiter import RateLimiter
from router.admission.redis_limiter import RateLimitKeys, RedisLimiter
from router.auth.config import RateLimits
from router.auth.keys import Principal
from router.core.stats import SecurityStats
from worker.redis_client import connect


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def bucket(name: str = "key:k:requests", limit: int = 6, burst: int | None = None,
           cost: int = 1, unit: str = "requests", scope: str = "key") -> Bucket:
    return Bucket(name, scope, unit, limit, burst or limit, cost)


def test_a_burst_is_allowed_then_the_rate_holds() -> None:
    clock = Clock()
    limiter = LocalLimiter(clock)
    decisions = [limiter.check("t", [bucket()]) for _ in range(7)]
    assert [d.allowed for d in decisions] == [True] * 6 + [False]
    assert [d.states[0].remaining for d in decisions[:6]] == [5, 4, 3, 2, 1, 0]
    assert decisions[6].retry_after_s == pytest.approx(10.0)  # 60 s / 6 per minute
    assert decisions[5].states[0].reset_s == pytest.approx(60.0)
    clock.now += 9.9
    assert not limiter.check("t", [bucket()]).allowed
    clock.now += 0.1
    assert limiter.check("t", [bucket()]).allowed


def test_buckets_are_charged_all_or_nothing() -> None:
    limiter = LocalLimiter(Clock())
    key = bucket("key:k:requests", limit=100)
    tenant = bucket("tenant:requests", limit=2, scope="tenant")
    assert limiter.check("t", [key, tenant]).allowed
    assert limiter.check("t", [key, tenant]).allowed
    refused = limiter.check("t", [key, tenant])
    assert not refused.allowed
    # The refused request did not use up the key's own budget.
    assert refused.states[0].remaining == 98
    assert limiter.check("t", [key]).states[0].remaining == 97


def test_tokens_cost_their_count() -> None:
    limiter = LocalLimiter(Clock())
    tokens = bucket("key:k:tokens", limit=1000, unit="tokens", cost=400)
    assert limiter.check("t", [tokens]).allowed
    assert limiter.check("t", [tokens]).allowed
    refused = limiter.check("t", [tokens])
    assert not refused.allowed
    assert refused.retry_after_s == pytest.approx(60 * 200 / 1000)


def test_sync_adopts_the_global_state() -> None:
    clock = Clock()
    limiter = LocalLimiter(clock)
    limiter.sync("t", bucket(), ahead_us=45e6)  # one request left in the global bucket
    assert limiter.check("t", [bucket()]).allowed
    assert not limiter.check("t", [bucket()]).allowed


def test_headers_report_the_tightest_bucket_per_unit() -> None:
    limiter = LocalLimiter(Clock())
    principal = Principal("k", "t", None, None,
                          RateLimits(requests_per_min=10, tokens_per_min=1000),
                          RateLimits(requests_per_min=4))
    buckets = buckets_for(principal, tokens=100)
    assert [b.name for b in buckets] == ["key:k:requests", "key:k:tokens", "tenant:requests"]
    headers = rate_limit_headers(limiter.check("t", buckets).states)
    assert headers == {
        "x-ratelimit-limit-requests": "4", "x-ratelimit-remaining-requests": "3",
        "x-ratelimit-reset-requests": "15s",
        "x-ratelimit-limit-tokens": "1000", "x-ratelimit-remaining-tokens": "900",
        "x-ratelimit-reset-tokens": "6s",
    }


def test_durations_read_like_openai_s() -> None:
    assert [duration(s) for s in (0.017, 1, 6.5, 90, 360)] == \
        ["17ms", "1s", "6.5s", "1m30s", "6m0s"]


async def test_an_unreachable_redis_falls_back_quickly_and_is_not_asked_again() -> None:
    redis = connect(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    stats = SecurityStats()
    limiter = RateLimiter(RedisLimiter(redis, RateLimitKeys("t")), stats=stats,
                          timeout_s=0.1, retry_s=30.0)
    try:
        started = time.monotonic()
        decisions = [await limiter.check("t", [bucket(limit=3)]) for _ in range(4)]
        assert time.monotonic() - started < 1.0
        assert [d.allowed for d in decisions] == [True, True, True, False]
        assert {d.source for d in decisions} == {"local"}
        assert stats.rate_limit_redis_errors == 1  # then it waits retry_s before asking
        assert not limiter.using_redis
    finally:
        await redis.aclose()


async def test_a_redis_that_never_answers_costs_one_bounded_wait() -> None:
    """A blackholed Redis (connection accepted, no reply) is given `timeout_s`, once."""
    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # read until the client gives up; never answer
        writer.close()

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    redis = connect(f"redis://127.0.0.1:{port}/0")
    stats = SecurityStats()
    limiter = RateLimiter(RedisLimiter(redis, RateLimitKeys("t")), stats=stats,
                          timeout_s=0.1, retry_s=30.0)
    try:
        started = time.monotonic()
        first = await limiter.check("t", [bucket()])
        first_s = time.monotonic() - started
        second = await limiter.check("t", [bucket()])
        assert first.allowed and first.source == "local"
        assert 0.09 < first_s < 1.0  # the bound, plus a loaded machine's slack
        assert second.source == "local"
        assert stats.rate_limit_redis_errors == 1  # the second did not ask Redis again
    finally:
        await redis.aclose()
        server.close()
        await server.wait_closed()


def test_each_tenant_has_its_own_local_buckets() -> None:
    """While Redis is out of reach, one tenant's use of its limit refuses no other tenant
    (the buckets' names are the same for every tenant)."""
    limiter = LocalLimiter(Clock())
    assert [limiter.check("globex", [bucket(limit=2)]).allowed for _ in range(3)] == [
        True, True, False]
    assert limiter.check("acme", [bucket(limit=2)]).allowed
