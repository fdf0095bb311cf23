"""worker.redis_client.connect's promises, on a real Valkey: when it hangs (SIGSTOP: it
accepts and never answers), a call fails within its socket timeout and one quick retry,
whatever the connection it gets from the pool, and sends nothing else first; and a task
cancelled in the middle of a call is cancelled (not carried on as if nothing happened)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from typing import Any

import pytest
import redis as redis_sync
from redis.exceptions import RedisError

from lab.devstack.valkey import EmbeddedValkey
from worker.redis_client import connect, connect_pubsub


async def test_a_call_on_a_long_idle_connection_to_a_hung_redis_fails_in_its_own_time() -> None:
    server = EmbeddedValkey.start()
    client = connect(server.url)
    try:
        await client.set("gptest:idle", 1)
        # As if every pooled connection had sat idle for minutes (the clock redis-py
        # checks before reusing one: a health check would be due).
        for connection in client.connection_pool._get_free_connections():
            connection.next_health_check = 0.0
        with redis_sync.Redis.from_url(server.url, socket_timeout=5) as plain:
            plain.config_resetstat()  # (the PING of the server's start-up check)
        os.kill(server.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises((RedisError, TimeoutError)):
                await client.set("gptest:idle", 2)
            took_s = time.monotonic() - started
        finally:
            os.kill(server.pid, signal.SIGCONT)
        # What the hung server was sent meanwhile, read once it runs again: the SET and
        # its retry, and no PING before them (a PING is one more 1 s timeout: 3.2 s).
        with redis_sync.Redis.from_url(server.url, socket_timeout=5) as plain:
            stats = plain.info("commandstats")
        assert "cmdstat_ping" not in stats, stats.get("cmdstat_ping")
        assert took_s < 3.0, took_s
    finally:
        await client.aclose()
        server.stop()


@pytest.mark.parametrize("opened", [connect, connect_pubsub], ids=["commands", "pub/sub"])
async def test_a_loop_of_redis_calls_stops_when_it_is_cancelled(
        redis_url: str, key_prefix: str, opened: Any) -> None:
    # A background loop (a heartbeat publisher, a batch runner, a peer exchange) cancelled
    # at a random moment, 300 times. redis-py sends under `asyncio.wait_for` when a socket
    # timeout is set, which on Python 3.11 drops a cancel that arrives as the send ends:
    # before connections kept the cancel, 81-98 of these 300 loops never stopped.
    client = opened(redis_url)
    rng = random.Random(7)
    calls = 0

    async def loop() -> None:
        nonlocal calls
        while True:
            await client.set(f"{key_prefix}:loop", "x" * 200)
            calls += 1
            await asyncio.sleep(0)

    carried_on = 0
    try:
        for _ in range(300):
            task = asyncio.create_task(loop())
            await asyncio.sleep(rng.random() * 0.002)
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=1.0)
            if not done:
                carried_on += 1
                for _ in range(100):  # (stopped, to go on: each cancel may be dropped)
                    task.cancel()
                    if (await asyncio.wait({task}, timeout=0.1))[0]:
                        break
                if carried_on == 3:
                    break
            elif not task.cancelled():
                task.result()  # (an error: shown)
        assert carried_on == 0, f"{carried_on} loops went on after their cancel"
        assert calls > 300, "the loops were cancelled while they made calls"
        assert await client.get(f"{key_prefix}:loop") == b"x" * 200, "the client still serves"
    finally:
        await client.aclose()
