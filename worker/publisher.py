"""The only place that writes heartbeats to Redis.

A heartbeat is a key that expires after `ttl_s` (so a silent worker leaves the pool on
its own) plus a pub/sub message (so routers learn of it in milliseconds). Both go in one
MULTI so that a router never sees a message for a key that was not written.
"""

from __future__ import annotations

import os
from enum import Enum
from typing import Literal

from redis.asyncio import Redis
from redis.exceptions import RedisError

from worker.redis_client import raise_if_cancelling
from worker.schema import Heartbeat, HeartbeatKeys
from worker.signing import HeartbeatSigner


class _Signer(Enum):
    FROM_ENVIRONMENT = "from-environment"


FROM_ENVIRONMENT: Literal[_Signer.FROM_ENVIRONMENT] = _Signer.FROM_ENVIRONMENT


class RedisUnavailableError(Exception):
    """Redis did not take a write (unreachable, timed out, or refused). Safe to retry."""


class HeartbeatPublisher:
    """Writes one worker's heartbeats under `keys`. Owns `redis` and closes it in `aclose`."""

    def __init__(
        self,
        redis: Redis,
        keys: HeartbeatKeys,
        signer: HeartbeatSigner | Literal[_Signer.FROM_ENVIRONMENT] | None = FROM_ENVIRONMENT,
    ) -> None:
        """`signer` signs every heartbeat; by default the key the environment names
        (worker.signing: GLOBALPOOL_HEARTBEAT_KEYS, ..._KEY_ID), unsigned when none is set.
        Raises worker.signing.SigningKeyError when the environment names a bad key."""
        self._redis = redis
        self._keys = keys
        self._signer = (HeartbeatSigner.from_environ(os.environ)
                        if signer is FROM_ENVIRONMENT else signer)

    async def publish(self, heartbeat: Heartbeat) -> None:
        """SET the key with a TTL of `heartbeat.ttl_s` and PUBLISH the same JSON.

        Raises RedisUnavailableError within about a second if Redis cannot be reached.
        """
        if self._signer is not None:
            heartbeat, payload = self._signer.signed_payload(heartbeat)
        else:
            payload = heartbeat.to_json().encode()
        ttl_ms = max(1, round(heartbeat.ttl_s * 1000))
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.set(self._keys.worker(heartbeat.worker_id), payload, px=ttl_ms)
                pipe.publish(self._keys.channel, payload)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            raise_if_cancelling()
            raise RedisUnavailableError(f"cannot publish heartbeat: {_describe(exc)}") from exc

    async def remove(self, worker_id: str) -> None:
        """DEL the key and PUBLISH `gone:<worker_id>` so routers drop the worker at once.

        Raises RedisUnavailableError; the key then still expires within its TTL.
        """
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.delete(self._keys.worker(worker_id))
                pipe.publish(self._keys.channel, self._keys.gone_message(worker_id))
                await pipe.execute()
        except (RedisError, OSError) as exc:
            raise_if_cancelling()
            raise RedisUnavailableError(f"cannot remove heartbeat: {_describe(exc)}") from exc

    async def aclose(self) -> None:
        await self._redis.aclose(close_connection_pool=True)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
