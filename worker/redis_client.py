"""The one way globalpool opens a Redis connection (workers and routers alike).

redis-py's defaults retry for many seconds against a partitioned server; here every
call fails in about `socket_timeout_s` (plus one quick retry), so callers can fail static
instead of hanging. Works with `redis://`, `rediss://` (TLS) and AUTH in the URL.
"""

from __future__ import annotations

import asyncio

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff


def connect(
    url: str,
    *,
    socket_timeout_s: float = 1.0,
    max_connections: int = 16,
    pool_wait_s: float = 1.0,
) -> Redis:
    """A client whose calls raise `redis.exceptions.RedisError` within ~1 s when Redis is gone.

    Pub/sub connections need no socket timeout on reads (they block waiting for messages);
    use `connect_pubsub` for those.
    """
    pool = BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=pool_wait_s,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=socket_timeout_s,
        retry=Retry(ExponentialBackoff(cap=0.2, base=0.05), retries=1),
        health_check_interval=10,
        decode_responses=False,
    )
    return Redis(connection_pool=pool)


def connect_pubsub(url: str, *, connect_timeout_s: float = 1.0) -> Redis:
    """A client for SUBSCRIBE: bounded connect time, no read timeout (reads wait for messages)."""
    pool = BlockingConnectionPool.from_url(
        url,
        max_connections=2,
        timeout=connect_timeout_s,
        socket_connect_timeout=connect_timeout_s,
        socket_timeout=None,
        retry=Retry(ExponentialBackoff(cap=0.2, base=0.05), retries=0),
        health_check_interval=5,
        decode_responses=False,
    )
    return Redis(connection_pool=pool)


def raise_if_cancelling() -> None:
    """Re-raise a cancellation that redis-py turned into a Redis error.

    A task cancelled in the middle of a command can see `ConnectionError` or
    `TimeoutError` instead of `CancelledError`; a loop that catches Redis errors and
    retries would then never stop. Call this first in such `except` blocks.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
