"""worker.redis_client.connect's promise, on a real Valkey that hangs (SIGSTOP: it accepts
and never answers): a call fails within its socket timeout and one quick retry, whatever
the connection it gets from the pool, and sends nothing else first."""

from __future__ import annotations

import os
import signal
import time

import pytest
import redis as redis_sync
from redis.exceptions import RedisError

from lab.devstack.valkey import EmbeddedValkey
from worker.redis_client import connect


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
