"""Drain flags: shared by every router replica through Redis.

An operator drains a region or a worker on any replica; the flag is written to one Redis
hash (`<prefix>:drains`, field `region:<name>` or `worker:<id>`, value a JSON record of
who, when and why). Every replica re-reads the hash every `poll_s` (0.5 s), so a drained
target gets no new requests on any replica within a second; the replica that took the
command applies it at once. Requests already running on a drained worker finish.

If Redis is unreachable the replica keeps the drain flags it last read (fail static) and
a drain command fails with a clear error instead of half-applying.

Drains are an operator's intent and must outlive a Redis that restarts empty (no
persistence, a failover to an empty replica). Every write also sets an epoch key
(`<prefix>:drains:epoch`) beside the hash. A replica that reads no epoch while it knows
flags concludes that Redis lost them, not that someone undrained (an undrain deletes
one field and leaves the epoch), and writes back what it knows, with a new epoch, an
event and a log line: every replica that knew the flags does so within one poll of Redis
answering again. An operator who wants them gone undrains.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from redis.asyncio import Redis
from redis.exceptions import RedisError

from router.registry.drained import NOTHING_DRAINED, Drained
from worker.redis_client import raise_if_cancelling
from worker.signing import document_signed_by, sign_document

log = logging.getLogger("globalpool.admin")

TargetKind = Literal["region", "worker"]


class DrainKeys:
    """The Redis name of the drain flags under one namespace prefix."""

    def __init__(self, prefix: str) -> None:
        self.hash = f"{prefix}:drains"
        self.epoch = f"{prefix}:drains:epoch"

    @staticmethod
    def field(kind: TargetKind, name: str) -> str:
        return f"{kind}:{name}"


@dataclass(frozen=True, slots=True)
class DrainRecord:
    """One drained target: what, since when (Unix seconds), why and from where."""

    kind: TargetKind
    name: str
    since_unix_s: float
    reason: str = ""
    by: str = ""

    def to_json(self, key: tuple[str, bytes] | None = None) -> str:
        """The record as Redis keeps it; signed with `key` (id, secret) when given."""
        document: dict[str, object] = {"kind": self.kind, "name": self.name,
                                       "since_unix_s": self.since_unix_s,
                                       "reason": self.reason, "by": self.by}
        if key is not None:
            sign_document(document, key)
        return json.dumps(document)

    @classmethod
    def from_json(cls, field: str, payload: bytes | str,
                  keys: Mapping[str, bytes] | None = None) -> DrainRecord | None:
        """The record in a hash field, or None when the field is not a drain's; with
        `keys` (heartbeat signing on), also None when it is not signed by one of them
        (`DrainStore` counts those as forged)."""
        kind, _, name = field.partition(":")
        if kind not in ("region", "worker") or not name:
            return None
        try:
            document = json.loads(payload)
        except (ValueError, RecursionError):  # (JSON nested deeper than Python recurses)
            document = {}
        if not isinstance(document, dict):
            document = {}
        if keys and not _signed_by(document, field, keys):
            return None
        since = document.get("since_unix_s")
        return cls(
            kind="region" if kind == "region" else "worker",
            name=name,
            # (NaN or infinity would make /admin/status's JSON invalid)
            since_unix_s=float(since) if isinstance(since, int | float)
            and math.isfinite(since) else 0.0,
            reason=str(document.get("reason") or ""),
            by=str(document.get("by") or ""),
        )


def _signed_by(document: Mapping[str, object], field: str,
               keys: Mapping[str, bytes]) -> bool:
    """Signed by one of `keys`, for the hash field it is in (a signature moved to another
    field does not drain that target)."""
    return (field == f"{document.get('kind')}:{document.get('name')}"
            and document_signed_by(document, keys))


class DrainHolder:
    """The drain flags in force on this replica; the request path reads `current`.

    `records` are the flags from Redis (set at run time); `configured` are the regions
    regions.yaml marks `drain: true`. Either drains a region.
    """

    __slots__ = ("configured", "current", "last_read_unix_s", "records")

    def __init__(self) -> None:
        self.current: Drained = NOTHING_DRAINED
        self.records: Mapping[str, DrainRecord] = MappingProxyType({})
        self.configured: frozenset[str] = frozenset()
        self.last_read_unix_s: float | None = None

    def replace(self, records: Mapping[str, DrainRecord]) -> None:
        self.records = MappingProxyType(dict(records))
        self._update()

    def set_configured(self, regions: frozenset[str]) -> None:
        if regions != self.configured:
            self.configured = regions
            self._update()

    def _update(self) -> None:
        records = self.records.values()
        self.current = Drained(
            regions=frozenset(r.name for r in records if r.kind == "region") | self.configured,
            workers=frozenset(r.name for r in records if r.kind == "worker"),
        )


class DrainError(Exception):
    """A drain or undrain that could not be stored (Redis unreachable). Its message is
    fixed, fit for the client; redis-py's detail (Redis' address) goes to the log only."""


UNREACHABLE = "Redis is unreachable; retry when it answers"


class DrainStore:
    """Reads and writes the drain flags; `run()` keeps `holder` current."""

    def __init__(self, redis: Redis, keys: DrainKeys, holder: DrainHolder,
                 *, poll_s: float = 0.5,
                 on_restored: Callable[[list[DrainRecord]], None] | None = None,
                 signing_keys: Mapping[str, bytes] | None = None) -> None:
        """`on_restored(records)`: this replica wrote back flags that Redis had lost.
        `signing_keys`: the heartbeat keys, when heartbeats are signed: flags are signed
        with the first, and a flag none of them signed is not believed (whoever can
        write to Redis could otherwise drain a region and move its traffic)."""
        self._redis = redis
        self._keys_signing = dict(signing_keys or {})
        self._signing_key = next(iter(self._keys_signing.items()), None)
        self.forged_total = 0  # flags read that no key signed (each counted once)
        self._forged: dict[str, bytes] = {}
        self._keys = keys
        self.holder = holder
        self._poll_s = poll_s
        self._on_restored = on_restored
        self.restored_total = 0  # flags written back after Redis lost them

    async def drain(self, kind: TargetKind, name: str, *, reason: str, by: str) -> DrainRecord:
        record = DrainRecord(kind, name, time.time(), reason, by)
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.hset(self._keys.hash, DrainKeys.field(kind, name),
                          record.to_json(self._signing_key))
                pipe.set(self._keys.epoch, _new_epoch(), nx=True)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            raise_if_cancelling()
            log.error("cannot store the drain flag %s in Redis: %s", DrainKeys.field(kind, name),
                      exc)  # the detail (it may name Redis' address) only in the log
            raise DrainError(f"the drain could not be stored: {UNREACHABLE}") from None
        await self.refresh()
        return record

    async def undrain(self, kind: TargetKind, name: str) -> bool:
        """Returns whether the target was drained."""
        try:
            removed = await self._redis.hdel(self._keys.hash, DrainKeys.field(kind, name))
        except (RedisError, OSError) as exc:
            raise_if_cancelling()
            log.error("cannot remove the drain flag %s in Redis: %s",
                      DrainKeys.field(kind, name), exc)
            raise DrainError(f"the undrain could not be stored: {UNREACHABLE}") from None
        await self.refresh()
        return bool(removed)

    async def refresh(self) -> None:
        """One full read of the flags; on a Redis error the last read stays in force.
        Flags that Redis lost (no epoch) are written back (see the module doc)."""
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.hgetall(self._keys.hash)
                pipe.exists(self._keys.epoch)
                raw, epoch_exists = await pipe.execute()
            if not epoch_exists and self.holder.records:
                await self._restore()
                return
        except (RedisError, OSError) as exc:
            raise_if_cancelling()
            log.debug("drain flags not refreshed (keeping the last read): %s", exc)
            return
        records: dict[str, DrainRecord] = {}
        forged: dict[str, bytes] = {}
        for key, payload in raw.items():
            field = key.decode(errors="replace") if isinstance(key, bytes) else str(key)
            record = DrainRecord.from_json(field, payload, self._keys_signing)
            if record is not None:
                records[field] = record
            elif self._keys_signing and DrainRecord.from_json(field, payload) is not None:
                forged[field] = payload if isinstance(payload, bytes) else str(payload).encode()
        self._count_forged(forged)
        if records != dict(self.holder.records):
            self.holder.replace(records)
        self.holder.last_read_unix_s = time.time()

    def _count_forged(self, forged: dict[str, bytes]) -> None:
        """Count and log the unsigned or forged flags read, each once."""
        new = [field for field, payload in forged.items() if self._forged.get(field) != payload]
        self._forged = forged
        if new:
            self.forged_total += len(new)
            log.warning("ignoring %d drain flag(s) not signed by a heartbeat key (forged, or "
                        "written before drains were signed: drain again to keep them): %s",
                        len(new), ", ".join(sorted(field[:80] for field in new))[:500])

    async def _restore(self) -> None:
        """Write back the flags this replica knows (Redis came back without them)."""
        known = list(self.holder.records.values())
        async with self._redis.pipeline(transaction=True) as pipe:
            for record in known:
                pipe.hsetnx(self._keys.hash, DrainKeys.field(record.kind, record.name),
                            record.to_json(self._signing_key))
            pipe.set(self._keys.epoch, _new_epoch(), nx=True)
            await pipe.execute()
        self.restored_total += len(known)
        log.warning("drain flags restored: Redis had lost them (it came back empty); "
                    "wrote back %s", ", ".join(f"{r.kind} {r.name}" for r in known))
        if self._on_restored is not None:
            self._on_restored(known)
        self.holder.last_read_unix_s = time.time()

    async def run(self) -> None:
        """Re-read the flags every `poll_s` until cancelled."""
        while True:
            await self.refresh()
            raise_if_cancelling()  # redis-py may have swallowed a cancellation
            await asyncio.sleep(self._poll_s)


def _new_epoch() -> str:
    return f"{time.time():.6f}-{secrets.token_hex(4)}"
