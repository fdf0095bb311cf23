"""The only place that writes heartbeats to Redis.

Every heartbeat, in one MULTI (so that a router never sees a message or record for a key
that was not written):
- the worker's key, which expires after `ttl_s` (a silent worker leaves the pool on its
  own), holding the heartbeat JSON: what a full read finds;
- the load record (worker.load_records.load_record) in its region's hash, which routers read
  for the whole region at once;
- a message on the routers' channel, only when something other than the load changed
  since the last heartbeat Redis took (the first one, a new state, models...): routers
  learn of those in milliseconds, and are not sent thousands of messages a second that
  only repeat a fleet's identity;
- the same JSON on the tap channel, for people and tools watching every heartbeat, while
  someone listens: when a tap message reached no subscriber (PUBLISH answers how many it
  reached), the next one goes out TAP_RECHECK_S later, so a fleet nobody watches does
  not send Redis a copy of every heartbeat (half its bytes), and a new watcher hears
  every worker within TAP_RECHECK_S.
(see worker.heartbeat_keys.HeartbeatKeys)
"""

from __future__ import annotations

import collections
import json
import logging
import os
import time
from collections.abc import Callable
from enum import Enum
from typing import Literal

from redis.asyncio import Redis
from redis.exceptions import RedisError

from worker.heartbeat_keys import HeartbeatKeys
from worker.load_records import load_record, static_digest
from worker.redis_client import close, publish, raise_if_cancelling
from worker.schema import Heartbeat
from worker.signing import HeartbeatSigner

log = logging.getLogger(__name__)

TAP_RECHECK_S = 10.0
OVERWRITTEN_LOG_EVERY_S = 60.0
WRITTEN_KEPT = 4  # heartbeats remembered per worker (see HeartbeatPublisher._written)


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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`signer` signs every heartbeat; by default the key the environment names
        (worker.signing: GLOBALPOOL_HEARTBEAT_KEYS, ..._KEY_ID), unsigned when none is set.
        Raises worker.signing.SigningKeyError when the environment names a bad key."""
        self._redis = redis
        self._keys = keys
        self._clock = clock
        self._tap_quiet_until_s = float("-inf")  # no tap message before (nobody listened)
        self._signer = (HeartbeatSigner.from_environ(os.environ)
                        if signer is FROM_ENVIRONMENT else signer)
        # What the routers' channel last carried of each worker (its static digest), and
        # the region it last heartbeat in (where its key and load record are).
        self._announced: dict[str, int] = {}
        self._regions: dict[str, str] = {}
        # The heartbeats last written for each worker (a few: a Redis failover may bring
        # back an older one), and when another was last found in its key in their stead
        # (see `_check_sole_writer`).
        self._written: dict[str, collections.deque[bytes]] = {}
        self._overwritten_logged_s: dict[str, float] = {}

    async def publish(self, heartbeat: Heartbeat) -> None:
        """Write one heartbeat (see the module doc).

        Raises RedisUnavailableError within about a second if Redis cannot be reached.
        """
        if self._signer is not None:
            heartbeat, payload = self._signer.signed_payload(heartbeat)
        else:
            payload = heartbeat.to_json().encode()
        worker_id = heartbeat.worker_id
        digest = static_digest(heartbeat)
        region = self._regions.get(worker_id)
        record: bytes | None = None
        if self._signer is not None:
            record = self._signer.signed_record(load_record(heartbeat, digest))
        elif heartbeat.signature is None:
            record = load_record(heartbeat, digest)
        # else signed by the caller, whose key this publisher does not have: no record it
        # could sign, so every heartbeat goes on the channel, as agents did before records.
        announce = (record is None or self._announced.get(worker_id) != digest
                    or region != heartbeat.region)
        ttl_ms = max(1, round(heartbeat.ttl_s * 1000))
        keys, sharded = self._keys, self._keys.sharded
        try:
            if region is not None and region != heartbeat.region:
                await self._forget(worker_id, region)  # it moved
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.set(keys.worker(worker_id, heartbeat.region), payload, px=ttl_ms,
                         get=True)
                if record is not None:
                    pipe.hset(keys.loads(heartbeat.region), worker_id, record)
                if announce:
                    publish(pipe, keys.region_channel(heartbeat.region), payload, sharded=sharded)
                tap = self._clock() >= self._tap_quiet_until_s
                if tap:
                    publish(pipe, keys.region_tap(heartbeat.region), payload, sharded=sharded)
                results = await pipe.execute()
            raise_if_cancelling()  # redis-py can return normally from a cancelled call
        except (RedisError, OSError) as exc:
            raise_if_cancelling()
            raise RedisUnavailableError(f"cannot publish heartbeat: {_describe(exc)}") from exc
        if tap and results and results[-1] == 0:  # nobody listens on the tap
            self._tap_quiet_until_s = self._clock() + TAP_RECHECK_S
        self._check_sole_writer(worker_id, results[0] if results else None, payload)
        self._announced[worker_id] = digest
        self._regions[worker_id] = heartbeat.region

    def _check_sole_writer(self, worker_id: str, previous: object, payload: bytes) -> None:
        """Warn (at most every OVERWRITTEN_LOG_EVERY_S per worker) when the worker's key
        held a heartbeat this publisher did not write since its last one: another agent
        publishes under the same worker id (a copied `--worker-id`), and routers see the
        worker's endpoint flip between two engines. (After Redis lost the key, or this
        agent's first write, there is nothing to compare: no warning.)"""
        written = self._written.get(worker_id)
        if written is None:
            written = self._written[worker_id] = collections.deque(maxlen=WRITTEN_KEPT)
        first = not written
        written.append(payload)
        if first or not isinstance(previous, bytes) or previous in written:
            return
        now_s = self._clock()
        if now_s - self._overwritten_logged_s.get(worker_id, float("-inf")) < \
                OVERWRITTEN_LOG_EVERY_S:
            return
        self._overwritten_logged_s[worker_id] = now_s
        try:
            endpoint = str(json.loads(previous).get("endpoint"))[:200]
        except (ValueError, AttributeError, RecursionError):
            endpoint = "(unreadable)"
        log.warning("worker %s: its heartbeat key held one this agent did not write "
                    "(endpoint %s): another agent publishes under the same worker id? "
                    "Routers see the worker flip between the two; give each its own "
                    "--worker-id", worker_id, endpoint)

    async def _forget(self, worker_id: str, region: str) -> None:
        """Remove what `worker_id` wrote as a worker of `region` (it now says another)."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hdel(self._keys.loads(region), worker_id)
            if self._keys.sharded:  # its heartbeat key has the region in its name
                pipe.delete(self._keys.worker(worker_id, region))
            await pipe.execute()

    async def remove(self, worker_id: str) -> None:
        """DEL the key and the load record and PUBLISH `gone:<worker_id>` so routers drop
        the worker at once.

        Raises RedisUnavailableError; the key then still expires within its TTL.
        """
        gone = self._keys.gone_message(worker_id)
        region = self._regions.get(worker_id)
        if region is None and self._keys.sharded:
            return  # never published here: nothing of it to remove
        keys, sharded = self._keys, self._keys.sharded
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.delete(keys.worker(worker_id, region))
                if region is not None:
                    pipe.hdel(keys.loads(region), worker_id)
                    publish(pipe, keys.region_channel(region), gone, sharded=sharded)
                    publish(pipe, keys.region_tap(region), gone, sharded=sharded)
                else:
                    publish(pipe, keys.channel, gone, sharded=sharded)
                    publish(pipe, keys.tap, gone, sharded=sharded)
                await pipe.execute()
            raise_if_cancelling()
        except (RedisError, OSError) as exc:
            raise_if_cancelling()
            raise RedisUnavailableError(f"cannot remove heartbeat: {_describe(exc)}") from exc
        self._announced.pop(worker_id, None)  # announced again if it comes back
        self._written.pop(worker_id, None)

    async def aclose(self) -> None:
        await close(self._redis)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
