"""Global rate limits across router replicas sharing Redis, and the local fallback."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter

import pytest

from lab.devstack.valkey import EmbeddedValkey
from router.auth.keys import hash_key
from tests.integration.test_security_fleet import CHAT, FleetFactory, auth_section, secure_fleet

__all__ = ["secure_fleet"]
pytestmark = pytest.mark.integration


async def test_a_key_over_its_limit_gets_429_from_every_replica(
    secure_fleet: FleetFactory,
) -> None:
    fleet = await secure_fleet({"a": "us-east"}, replicas=2)
    remaining = []
    for replica in (0, 1, 0):
        status, headers, body = await fleet.chat("small", replica=replica)
        assert status == 200, body
        assert headers["x-ratelimit-limit-requests"] == "3"
        remaining.append(headers["x-ratelimit-remaining-requests"])
    assert remaining == ["2", "1", "0"]
    for replica in (1, 0):
        status, headers, body = await fleet.chat("small", replica=replica)
        assert status == 429
        error = json.loads(body)["error"]
        assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
        assert 1 <= int(headers["Retry-After"]) <= 20  # one request per 20 s refills
        assert headers["x-ratelimit-remaining-requests"] == "0"
        assert headers["x-ratelimit-reset-requests"].endswith("s")
    # Other keys are not affected, and streams carry the headers too.
    status, headers, _ = await fleet.chat("acme", {**CHAT, "stream": True})
    assert status == 200 and "x-ratelimit-limit-requests" not in headers
    assert fleet.stats(0).rate_limited[("key", "requests")] == 1
    assert fleet.stats(1).rate_limited[("key", "requests")] == 1
    assert fleet.stats(0).rate_limit_source["local"] == 0


async def test_a_tenant_limit_is_shared_by_its_keys(secure_fleet: FleetFactory) -> None:
    auth = {
        "tenants": {"team": {"limits": {"requests_per_min": 4, "tokens_per_min": 10_000}}},
        "keys": [{"id": f"team-{n}", "tenant": "team", "sha256": hash_key(f"gp-team-{n}")}
                 for n in (1, 2)],
        "rate_limits": {"redis_timeout_ms": 1000},  # see auth_section
    }
    fleet = await secure_fleet({"a": "us-east"}, auth=auth, replicas=2)
    statuses = []
    for n in range(6):
        status, headers, _ = await fleet.chat(
            None, replica=n % 2, headers={"Authorization": f"Bearer gp-team-{1 + n // 3}"})
        statuses.append(status)
    assert statuses == [200, 200, 200, 200, 429, 429]
    assert "x-ratelimit-limit-tokens" in headers
    assert fleet.stats(0).rate_limited[("tenant", "requests")] + \
        fleet.stats(1).rate_limited[("tenant", "requests")] == 2


async def test_tokens_per_minute_count_prompt_and_max_tokens(
    secure_fleet: FleetFactory,
) -> None:
    fleet = await secure_fleet({"a": "us-east"},
                               auth=auth_section(acme={"key_limits": {"tokens_per_min": 100}}))
    body = {**CHAT, "max_tokens": 40}  # about 3 prompt tokens + 40
    results = [await fleet.chat("acme", body) for _ in range(3)]
    assert [status for status, _, _ in results] == [200, 200, 429]
    assert results[0][1]["x-ratelimit-limit-tokens"] == "100"
    assert int(results[1][1]["x-ratelimit-remaining-tokens"]) < 20
    assert json.loads(results[2][2])["error"]["message"].startswith(
        "Rate limit reached for tokens per minute")
    status, headers, body_bytes = await fleet.chat("acme", {**CHAT, "max_tokens": 500})
    assert status == 429 and "Retry-After" not in headers  # waiting would never help
    assert json.loads(body_bytes)["error"]["code"] == "request_too_large"


async def test_the_local_limiter_holds_while_redis_is_stopped(
    secure_fleet: FleetFactory,
) -> None:
    server = EmbeddedValkey.start()
    try:
        fleet = await secure_fleet({"a": "us-east"}, redis=server.url, replicas=1)
        status, headers, _ = await fleet.chat("small")
        assert (status, headers["x-ratelimit-remaining-requests"]) == (200, "2")
        server.stop()
        timings: list[float] = []
        statuses: list[int] = []
        for _ in range(4):
            started = time.monotonic()
            status, headers, _ = await fleet.chat("small")
            timings.append(time.monotonic() - started)
            statuses.append(status)
        # The local limiter started from the global state (one used) and holds the limit.
        assert statuses == [200, 200, 429, 429]
        assert max(timings) < 2.0, timings  # Redis is not waited for (75 ms at most)
        stats = fleet.stats()
        assert stats.rate_limit_source == Counter({"redis": 1, "local": 4})
        assert stats.rate_limit_redis_errors == 1  # then not asked again for redis_retry_s
        status, _, _ = await fleet.chat("acme")  # unlimited keys still flow (fail static)
        assert status == 200

        server = EmbeddedValkey.start(port=server.port)
        deadline = time.monotonic() + 10
        while stats.rate_limit_source["redis"] < 2:
            assert time.monotonic() < deadline, "the limiter never went back to Redis"
            await fleet.chat("small")
            await asyncio.sleep(0.2)
    finally:
        server.stop()
