"""The regions' load records, read in one round trip and taken into the worker table.

Each record is a worker's newest load and order, applied onto the full heartbeat it was
taken with (the record names it by a digest; when they differ, or the worker is unknown,
the worker's key is read). Records of workers nobody has heard of for ORPHAN_RECORD_AGE_S
are deleted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from redis.asyncio import Redis

from router.registry.pace import Pace
from router.registry.refusals import WORKER_ID_MISMATCH, WRONG_REGION, Refusals
from router.registry.worker_table import HeartbeatCheck, WorkerTable
from router.registry.worker_view import WorkerView
from worker.heartbeat_keys import HeartbeatKeys
from worker.load_records import LoadRecord, record_items
from worker.redis_client import mget
from worker.schema import Refused

log = logging.getLogger("globalpool.registry")

# Load records taken in one go before the event loop gets a turn: taking in 10,000 at once
# kept every request waiting ~50 ms (a router's /health answered in up to 63 ms during the
# heartbeat bench); 200 take ~1-2 ms (signed: ~2 ms). A request needs several turns, so
# the chunk counts several times (bench-proxy --only globalpool-fleet: paced TTFT p99 over
# its control +23 ms with 500 a turn, +7 ms with 200).
RECORDS_PER_TURN = 200
# A load record of a worker no router knows (its agent crashed: its key expired, the
# record stayed) is deleted once it is this old.
ORPHAN_RECORD_AGE_S = 300.0

RecordCheck = Callable[[LoadRecord, bytes, WorkerView], "str | None"]


class LoadRecords:
    """Reads every region's load records (`read`) and takes those that changed.

    `regions`: the regions with load records, as the last full read scanned them (with
    the regions of the workers in the table). Counts records read that had changed since
    the last read (`read_records`) and of those taken (`applied_records`), heartbeat keys
    read for a record (`worker_reads`: unknown worker, changed heartbeat) and round trips
    (`reads`)."""

    def __init__(self, *, redis: Redis, keys: HeartbeatKeys, table: WorkerTable,
                 pace: Pace, gate: HeartbeatCheck | None, refusals: Refusals) -> None:
        self._redis = redis
        self._keys = keys
        self._table = table
        self._views = table.views
        self._records = table.records
        self._local_inflight = table.local_inflight
        self._pace = pace
        self._gate = gate
        self._refusals = refusals
        self._wall_clock = time.time
        self.regions: set[str] = set()
        # Records of workers not in the table: (region, sent at), for ORPHAN_RECORD_AGE_S.
        self.orphans: dict[bytes, tuple[str, float]] = {}
        # Records refused for what they are (not a record, another worker's name), by
        # region and field: unlike the table's records as last read, kept when their
        # worker leaves the table, so that the same bytes are not refused, and counted,
        # again at the next read.
        self._refused: dict[str, dict[bytes, bytes]] = {}
        self.read_records = 0
        self.applied_records = 0
        self.worker_reads = 0
        self.reads = 0

    async def read(self) -> bool:
        """Read every region's load records in one round trip and apply those that
        changed (see the module doc). Whether any view changed."""
        regions = sorted(self.regions.union(view.region for view in self._views.values()))
        if not regions:
            return False
        self.reads += 1
        async with self._redis.pipeline(transaction=False) as pipe:
            for region in regions:
                pipe.hgetall(self._keys.loads(region))
            replies = await pipe.execute()
        to_read: list[str] = []
        changed = await self._take(regions, replies, to_read)
        if to_read:
            changed |= await self._read_workers(to_read)
        if self.orphans:
            await self._delete_orphans()
        return changed

    async def _take(self, regions: list[str], replies: list[dict[bytes, bytes]],
                    to_read: list[str]) -> bool:
        """Apply the records read of `regions` that changed since the last read,
        RECORDS_PER_TURN at a time; those whose heartbeat must be read go in `to_read`."""
        started = time.thread_time()
        now = self._table.clock()
        self._table.last_ok_at_s = now  # Redis answered: its clock runs (WorkerTable)
        changed = False
        gate = self._gate  # asked once a read: whether records go to it (HeartbeatCheck)
        check = gate.check_record if gate is not None and gate.signing else None
        next_read_s = self._pace.next_read_s()
        pace = self._pace
        pace.apply_s = 0.0
        taken = 0
        for region, records in zip(regions, replies, strict=True):
            seen = self._records.setdefault(region, {})
            refused = self._refused.get(region)
            for worker, payload in records.items():
                if seen.get(worker) == payload:
                    continue
                seen[worker] = payload
                if refused is not None and refused.get(worker) == payload:
                    continue
                changed |= self._apply_record(region, worker, payload, now, to_read, check,
                                              next_read_s)
                taken += 1
                if taken % RECORDS_PER_TURN == 0:
                    # Requests wait while this runs: let them through (see RECORDS_PER_TURN).
                    pace.apply_s += pace.spent(started)
                    await asyncio.sleep(0)
                    started = time.thread_time()
        pace.apply_s += pace.spent(started)
        return changed

    def _apply_record(self, region: str, worker: bytes, payload: bytes, now: float,
                      to_read: list[str], check: RecordCheck | None,
                      next_read_s: float) -> bool:
        """Take one changed load record if it is valid, newer and of the heartbeat the
        router has, and `check` (the gate's, when it signs) passes it; a record of a
        worker the router does not know (a new one whose message was lost, one that aged
        out while Redis was out of reach) or whose heartbeat has changed goes in
        `to_read`: its heartbeat key is read next. Runs for every worker at every read:
        the record stays the tuple of its items (by position: worker.schema.
        RecordItems). `next_read_s`: see pace.NEXT_READ_INTERVALS."""
        self.read_records += 1
        try:
            record = record_items(payload)
        except Refused as exc:
            self._refuse(region, worker, payload, exc.reason, str(exc))
            return False
        worker_id, seq, sent_at_s = record[1], record[2], record[3]
        if worker_id.encode() != worker:
            self._refuse(region, worker, payload, WORKER_ID_MISMATCH,
                         f"names worker {worker_id[:60]!r}")
            return False
        view = self._views.get(worker_id)
        if view is None:
            self.orphans[worker] = (region, sent_at_s)  # deleted if it stays so
            to_read.append(self._keys.worker(worker_id, region))
            return False
        if view.region != region:
            self._refusals.refuse(WRONG_REGION, f"load record of {worker_id!r} in region "
                                  f"{region[:60]!r}, but it heartbeats in {view.region!r}")
            return False
        if record[4] != view.static_digest:
            to_read.append(self._keys.worker(worker_id, region))  # more than its load changed
            return False
        if sent_at_s < view.sent_at_s or (sent_at_s == view.sent_at_s and seq <= view.seq):
            return False  # not newer than what the router has (a replay, or no news)
        if check is not None and check(LoadRecord.of(record), payload, view):
            return False  # unsigned, forged or stale: counted by the gate
        self._views[worker_id] = view.with_load(record, now, self._local_inflight(worker_id),
                                                next_read_s)
        self.applied_records += 1
        return True

    def _refuse(self, region: str, worker: bytes, payload: bytes, reason: str,
                why: str) -> None:
        """Count a record refused for what it is, once (see `_refused`)."""
        self._refused.setdefault(region, {})[worker] = payload
        self._refusals.refuse(reason, f"load record {worker[:60]!r} in region "
                                      f"{region[:60]!r}: {why}")

    async def _read_workers(self, keys: list[str]) -> bool:
        """Read these workers' heartbeat keys (see `_apply_record`)."""
        self.worker_reads += len(keys)
        payloads = await mget(self._redis, keys)
        started = time.thread_time()
        table = self._table
        now = table.clock()
        changed = False
        for payload in payloads:
            if payload is not None:
                view = table.parse(payload, now)
                changed |= view is not None and table.store(view, force=False)
        self._pace.spent(started)
        return changed

    async def _delete_orphans(self) -> None:
        """Delete records of unknown workers that are ORPHAN_RECORD_AGE_S old; forget the
        ones whose workers are known now (a router started beside a running fleet reads
        every record before it knows their workers: kept, they were scanned at every read
        for ORPHAN_RECORD_AGE_S, ~5 ms a read at 10,000 workers)."""
        cutoff = self._wall_clock() - ORPHAN_RECORD_AGE_S
        views = self._views
        old: list[tuple[bytes, str]] = []
        unknown: dict[bytes, tuple[str, float]] = {}
        for worker, (region, sent_at_s) in self.orphans.items():
            if worker.decode(errors="replace") in views:
                continue
            if sent_at_s < cutoff:
                old.append((worker, region))
            else:
                unknown[worker] = (region, sent_at_s)
        self.orphans = unknown
        if old:
            async with self._redis.pipeline(transaction=False) as pipe:
                for worker, region in old:
                    pipe.hdel(self._keys.loads(region), worker)
                    self._records.get(region, {}).pop(worker, None)
                await pipe.execute()
            log.info("deleted %d load records of workers unheard of for %.0f s",
                     len(old), ORPHAN_RECORD_AGE_S)
