"""Batches and their lines' state in Redis, shared by every replica.

One batch's keys share a hash tag (`{batch_...}`: one slot in a Redis Cluster), so each
step below is one atomic script or transaction:

    <p>:batch:{B}            hash: `doc` (what never changes, JSON) and its
                             `doc_signature` (router.batch.seal), status, model, total,
                             counts (completed, failed, reruns, takeovers), timestamps,
                             output/error file ids, errors (JSON), `end` (what finalizing
                             makes it: completed, cancelled or expired)
    <p>:batch:{B}:todo       list: chunks (of CHUNK_LINES lines) no replica holds yet
    <p>:batch:{B}:leases     sorted set: chunk -> when its lease ends (Redis's clock, ms)
    <p>:batch:{B}:holders    hash: chunk -> the replica holding it
    <p>:batch:{B}:results    hash: line index -> its output or error line (JSON), sealed
    <p>:batch:{B}:lock:<job> validation and finalization locks (SET NX PX)
    <p>:batches:active       set: batches that are not finished yet (runners scan it)
    <p>:batches:owner:<o>    sorted set: a tenant's batches by creation time (listing)

**Exactly once in the output**: a line's result is written with HSETNX, so however many
times a line runs (a replica that stalled past its lease, one that died after running a
line and before releasing its chunk) the first result stays; every later one is counted
in `reruns`. A chunk whose lease ends (its replica died) goes back to the front of `todo`
at the next claim, counted in `takeovers`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import RedisError, WatchError

from router.batch import scripts
from router.batch.entries import error_line
from router.batch.lines import CheckedInput, LineFault
from router.batch.record import Batch, well_formed
from router.batch.seal import Seal
from worker.redis_client import raise_if_cancelling

log = logging.getLogger("globalpool.batch")

CHUNK_LINES = 16  # lines per lease: small enough that replicas share a batch evenly
FORGED_REMEMBERED = 1_000  # batches whose forged record was logged (each once)
T = TypeVar("T")


class BatchesUnavailable(Exception):
    """Redis could not be asked."""


class BatchStore:
    """Reads and changes batches in Redis (see the module doc). Every method raises
    BatchesUnavailable when Redis cannot be reached."""

    def __init__(self, redis: Redis, prefix: str,
                 keys: Mapping[str, bytes] | None = None) -> None:
        """`keys`: the heartbeat keys, when heartbeats are signed: records are sealed
        with the first, and one none of them sealed is not found (router.batch.seal)."""
        self._redis = redis
        self._prefix = prefix
        self._seal = Seal(keys)
        self._forged: set[str] = set()
        self._claim = redis.register_script(scripts.CLAIM)
        self._renew = redis.register_script(scripts.RENEW)
        self._release = redis.register_script(scripts.RELEASE)
        self._leases_held = redis.register_script(scripts.LEASES_HELD)
        self._record = redis.register_script(scripts.RECORD)
        self._move = redis.register_script(scripts.MOVE)

    # --- keys ---------------------------------------------------------------------------
    def key(self, batch_id: str, part: str = "") -> str:
        return f"{self._prefix}:batch:{{{batch_id}}}{':' + part if part else ''}"

    @property
    def _active(self) -> str:
        return f"{self._prefix}:batches:active"

    def _owned(self, owner: str | None) -> str:
        return f"{self._prefix}:batches:owner:{owner or '-'}"

    def _unfinished(self, owner: str | None) -> str:
        return f"{self._prefix}:batches:unfinished:{owner or '-'}"

    # --- the API's side -----------------------------------------------------------------
    async def unfinished(self, owner: str | None) -> int:
        """How many of `owner`'s batches have not finished (ids whose batch Redis lost are
        dropped from the count as they are found)."""
        key = self._unfinished(owner)
        try:
            ids = await self._redis.smembers(key)
            gone = [batch_id for batch_id in ids
                    if not await self._redis.exists(self.key(_text(batch_id)))]
            if gone:
                await self._redis.srem(key, *gone)
        except (RedisError, OSError) as exc:
            raise_if_cancelling()
            raise BatchesUnavailable(str(exc)) from exc
        return len(ids) - len(gone)

    async def create(self, doc: Mapping[str, Any]) -> Batch:
        """A new batch, `validating`; `doc` as Batch.doc has it, with its `id`."""
        batch_id = str(doc["id"])
        text = json.dumps(dict(doc), separators=(",", ":"))
        fields: dict[Any, str] = {
            "doc": text, "doc_signature": self._seal.of(batch_id, text), "status": "validating",
            "total": "0", "completed": "0", "failed": "0"}
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.hset(self.key(batch_id), mapping=fields)
                pipe.sadd(self._active, batch_id)
                pipe.zadd(self._owned(doc.get("owner")), {batch_id: doc["created_at"]})
                pipe.sadd(self._unfinished(doc.get("owner")), batch_id)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            raise_if_cancelling()
            raise BatchesUnavailable(str(exc)) from exc
        return Batch(batch_id, dict(doc), "validating", fields)

    async def get(self, batch_id: str, owner: str | None = None, *,
                  any_owner: bool = False) -> Batch | None:
        """The batch, or None when there is none (or it is another tenant's)."""
        raw = await self._call(self._redis.hgetall(self.key(batch_id)))
        if not raw or b"doc" not in raw:
            return None
        fields = {_text(key): _text(value) for key, value in raw.items()}
        text = fields.pop("doc")
        if not self._seal.holds(fields.get("doc_signature"), batch_id, text):
            self._log_forged(batch_id, "its record is not sealed by any heartbeat key")
            return None
        try:
            doc = json.loads(text)
        except (ValueError, RecursionError):
            doc = None
        if not well_formed(doc, fields):
            # Damaged or forged (anyone who can write to Redis can): one such record costs
            # its own batch, never every tenant's (the runner drops it from its scan).
            log.warning("batch %s: its record in Redis is malformed; left out",
                        batch_id[:80])
            return None
        batch = Batch(batch_id, doc, fields.get("status", ""), fields)
        if not any_owner and batch.owner != owner:
            return None
        return batch

    async def page(self, owner: str | None, limit: int, after: str | None
                   ) -> tuple[list[Batch], bool]:
        """A tenant's batches, newest first, after the batch `after`; and whether more
        follow. Paged by rank, not by creation time: batches created in the same second
        (scored alike, ordered by id) are each listed once; one created since, ranked
        before `after`, moves `after`'s rank with it. Single-key commands on the
        tenant's one key, as a Redis Cluster needs."""
        key = self._owned(owner)
        try:
            start = 0
            if after is not None:
                rank = await self._redis.zrevrank(key, after)
                if not isinstance(rank, int):  # (None: no such batch of this tenant's)
                    return [], False
                start = rank + 1
            ids = await self._redis.zrevrange(key, start, start + limit)
        except (RedisError, OSError) as exc:
            raise_if_cancelling()
            raise BatchesUnavailable(str(exc)) from exc
        batches = [batch for batch_id in ids[:limit]
                   if (batch := await self.get(_text(batch_id), owner)) is not None]
        return batches, len(ids) > limit

    async def cancel(self, batch_id: str) -> bool:
        """validating or in_progress -> cancelling (no more lines start); False when the
        batch had already ended or was ending."""
        return await self._moved(batch_id, "cancelling", "cancelled",
                                 ("validating", "in_progress"))

    # --- the runners' side --------------------------------------------------------------
    async def active(self) -> list[str]:
        members = await self._call(self._redis.smembers(self._active))
        return sorted(_text(member) for member in members)

    async def lock(self, batch_id: str, job: str, holder: str, ms: int) -> bool:
        """Whether `holder` now holds the batch's `job` lock (for `ms`, unless released)."""
        return bool(await self._call(self._redis.set(self.key(batch_id, f"lock:{job}"),
                                                     holder, nx=True, px=ms)))

    async def validated(self, batch: Batch, checked: CheckedInput, now_s: int) -> bool:
        """Write the outcome of validation: `failed` with the file's faults, or
        `in_progress` with its chunks queued and its faulty lines' error entries written.
        False (nothing written) when the batch is no longer `validating`."""
        key = self.key(batch.id)

        def write(pipe: Pipeline) -> None:
            if checked.faults:
                pipe.hset(key, mapping={
                    "status": "failed", "failed_at": now_s,
                    "errors": json.dumps([fault.to_openai() for fault in checked.faults])})
                pipe.srem(self._active, batch.id)
                pipe.srem(self._unfinished(batch.owner), batch.id)
                return
            faults = [line for line in checked.lines if isinstance(line, LineFault)]
            if faults:
                pipe.hset(self.key(batch.id, "results"), mapping={
                    fault.index: self._seal.wrap(batch.id, fault.index, error_line(
                        batch.id, fault.index, fault.custom_id, fault.code, fault.message))
                    for fault in faults})
            chunks = range((checked.total + CHUNK_LINES - 1) // CHUNK_LINES)
            if chunks:
                pipe.rpush(self.key(batch.id, "todo"), *chunks)
            pipe.hset(key, mapping={
                "status": "in_progress", "in_progress_at": now_s,
                "model": checked.model or "", "total": checked.total, "failed": len(faults)})

        return await self._if_status(key, (b"validating",), write)

    async def claim(self, batch_id: str, holder: str, lease_ms: int) -> tuple[str, int | None, int]:
        """(status, a chunk now leased to `holder` or None, leases held in all)."""
        status, chunk, held = await self._script(
            self._claim, [self.key(batch_id), self.key(batch_id, "todo"),
                          self.key(batch_id, "leases"), self.key(batch_id, "holders")],
            [lease_ms, holder])
        return (status.decode() if isinstance(status, bytes) else str(status),
                None if int(chunk) < 0 else int(chunk), int(held))

    async def renew(self, batch_id: str, chunk: int, holder: str, lease_ms: int
                    ) -> tuple[str, bool]:
        """(status, whether `holder` still holds `chunk`, its lease now renewed)."""
        status, held = await self._script(
            self._renew, [self.key(batch_id), self.key(batch_id, "leases"),
                          self.key(batch_id, "holders")], [chunk, lease_ms, holder])
        return (status.decode() if isinstance(status, bytes) else str(status)), bool(held)

    async def release(self, batch_id: str, chunk: int, holder: str) -> None:
        await self._script(self._release, [self.key(batch_id, "leases"),
                                           self.key(batch_id, "holders")], [chunk, holder])

    async def missing(self, batch_id: str, indexes: list[int]) -> list[int]:
        """Those of `indexes` with no result yet."""
        if not indexes:
            return []
        present = await self._call(self._redis.hmget(self.key(batch_id, "results"), indexes))
        return [index for index, value in zip(indexes, present, strict=True) if value is None]

    async def record(self, batch_id: str, index: int, line: str, ok: bool) -> bool | None:
        """Record line `index`'s result; False when it already had one (a rerun), None
        when the batch is gone (nothing written)."""
        recorded = int(await self._script(
            self._record, [self.key(batch_id), self.key(batch_id, "results")],
            [index, self._seal.wrap(batch_id, index, line), "completed" if ok else "failed"]))
        return None if recorded < 0 else bool(recorded)

    async def begin_finalizing(self, batch_id: str, now_s: int, end: str = "") -> bool:
        """in_progress -> finalizing (`end`: "expired" also from validating, dropping what
        is not done; "" for a batch all of whose lines are done)."""
        sources = ("in_progress",) if not end else ("in_progress", "validating")
        return await self._moved(batch_id, "finalizing", end, sources, now_s)

    async def results(self, batch_id: str) -> dict[int, str | None]:
        """Every line's result, the batch sealed first: a line that ends later (on a
        replica that stalled past its lease) is not recorded, but counted as a rerun.
        None for a result whose seal is not valid (router.batch.seal); indexes that are
        not numbers are left out (neither was written by a router)."""
        await self._call(self._redis.hset(self.key(batch_id), "sealed", 1))
        raw = await self._call(self._redis.hgetall(self.key(batch_id, "results")))
        results: dict[int, str | None] = {}
        for index, value in raw.items():
            number = _text(index)
            if number.isdigit() and len(number) <= 9:
                results[int(number)] = self._seal.unwrap(batch_id, int(number), _text(value))
        forged = sum(result is None for result in results.values())
        if forged:
            self._log_forged(batch_id, f"{forged} result(s) not sealed by any heartbeat key "
                                       "are replaced by errors (result_not_signed)")
        return results

    async def leases_held(self, batch_id: str) -> int:
        """Leases that have not ended (one that has ended holds nothing: its replica died),
        by Redis's clock, which set them: a replica whose clock runs ahead would otherwise
        see leases end early and finalize a batch whose lines another replica still runs."""
        return int(await self._script(self._leases_held, [self.key(batch_id, "leases")], []))

    async def finished(self, batch: Batch, status: str, now_s: int,
                       output_file_id: str | None, error_file_id: str | None) -> bool:
        """finalizing/cancelling -> `status` with its files; the lines' state dropped."""
        key = self.key(batch.id)

        def write(pipe: Pipeline) -> None:
            pipe.hset(key, mapping={"status": status, f"{status}_at": now_s,
                                    "output_file_id": output_file_id or "",
                                    "error_file_id": error_file_id or ""})
            for part in ("todo", "leases", "holders", "results"):
                pipe.delete(self.key(batch.id, part))
            pipe.srem(self._active, batch.id)
            pipe.srem(self._unfinished(batch.owner), batch.id)

        return await self._if_status(key, (b"finalizing", b"cancelling"), write)

    async def drop_active(self, batch_id: str) -> None:
        """A batch id in the active set whose batch is gone (Redis lost it)."""
        await self._call(self._redis.srem(self._active, batch_id))

    # --- helpers ------------------------------------------------------------------------
    def _log_forged(self, batch_id: str, what: str) -> None:
        """Say once per batch (of the last FORGED_REMEMBERED) that its record was forged:
        the runners scan every active batch every second."""
        if batch_id in self._forged:
            return
        if len(self._forged) >= FORGED_REMEMBERED:
            self._forged.clear()
        self._forged.add(batch_id)
        log.warning("batch %s: %s; written by someone without the keys (router.batch."
                    "seal)", batch_id[:80], what)

    async def _if_status(self, key: str, statuses: tuple[bytes, ...],
                         write: Callable[[Pipeline], None]) -> bool:
        """Run `write`'s commands in one transaction if the batch's status is one of
        `statuses` until it commits; False (nothing written) otherwise."""
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                await pipe.watch(key)
                if (await pipe.hget(key, "status")) not in statuses:
                    return False
                pipe.multi()  # type: ignore[no-untyped-call]  # untyped in redis-py
                write(pipe)
                await pipe.execute()
        except WatchError:
            return False
        except (RedisError, OSError) as exc:
            raise_if_cancelling()
            raise BatchesUnavailable(str(exc)) from exc
        return True

    async def _moved(self, batch_id: str, to: str, end: str, sources: tuple[str, ...],
                     now_s: int | None = None) -> bool:
        now = int(time.time()) if now_s is None else now_s
        return bool(await self._script(
            self._move, [self.key(batch_id), self.key(batch_id, "todo")],
            [to, now, end, *sources]))

    async def _script(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        return await self._call(script(keys=keys, args=args))

    async def _call(self, call: Awaitable[T]) -> T:
        """Await a Redis call; BatchesUnavailable if Redis cannot be asked."""
        try:
            return await call
        except (RedisError, OSError) as exc:
            raise_if_cancelling()
            raise BatchesUnavailable(str(exc)) from exc


def _text(value: Any) -> str:
    """A Redis reply's bytes as text (str when the client decodes replies itself)."""
    return value.decode() if isinstance(value, bytes) else str(value)
