"""The collector's full read: SCAN + MGET of every heartbeat key, into the worker table.

At start, after every reconnect and every Pace.full_read_every_s: repairs anything a lost
message left out (between two reconnects it parses only the keys of workers not heard from
since the last one), finds the regions with load records, and doubles as the liveness
check of Redis (a blackholed server shows up as a timeout here).
"""

from __future__ import annotations

import time

from redis.asyncio import Redis

from router.registry.load_records import LoadRecords
from router.registry.pace import Pace
from router.registry.worker_table import WorkerTable
from worker.heartbeat_keys import HeartbeatKeys
from worker.redis_client import mget

# Heartbeat keys read in one MGET.
KEYS_PER_READ = 500


class FullRead:
    """`await full_read.run(reconnected=...)`: one full read (see the module doc); sets
    `loads.regions` to the regions it finds load records in."""

    def __init__(self, *, redis: Redis, keys: HeartbeatKeys, table: WorkerTable,
                 pace: Pace, loads: LoadRecords) -> None:
        self._redis = redis
        self._keys = keys
        self._table = table
        self._pace = pace
        self._loads = loads

    async def run(self, *, reconnected: bool = False) -> None:
        keys: list[bytes] = []
        async for key in self._redis.scan_iter(match=self._keys.pattern, count=1000):
            keys.append(key)
        regions: set[str] = set()
        async for key in self._redis.scan_iter(match=self._keys.loads_pattern, count=1000):
            regions.add(self._keys.region_of_loads(key))
        self._loads.regions = regions
        table = self._table
        now = table.clock()
        if not reconnected:
            keys = self._unheard_of(keys, now)
        seen = await self._take(keys, now)
        # A worker whose key is missing is not dropped here: a deleted one said `gone:`,
        # and any other ages out by its TTL on this collector's clock (see
        # router.registry.collector's module doc). Redis's own key expiry cannot be trusted
        # for that: after Redis restarts empty, or after a stall of Redis's host, keys are
        # missing although their workers are alive and about to re-publish.
        if reconnected:
            # Redis may have come back empty: a worker that has not re-published yet keeps
            # its place for one TTL from now; its next heartbeat, or expiry, settles it.
            next_read_s = self._pace.next_read_s()
            views = table.views
            for worker_id in [w for w in views if w not in seen]:
                views[worker_id] = views[worker_id].received_again(now, next_read_s)
        table.last_ok_at_s = table.clock()

    def _unheard_of(self, keys: list[bytes], now: float) -> list[bytes]:
        """Workers this router heard from since the last full read (a message or a load
        record, which are newer than their key) need not be parsed again: what is left to
        repair is a worker it does not know or has not heard from."""
        views = self._table.views
        since_s = now - self._pace.full_read_every_s(len(views))
        worker_id = self._keys.worker_id
        return [key for key in keys
                if (view := views.get(worker_id(key))) is None
                or view.received_at_s < since_s]

    async def _take(self, keys: list[bytes], now: float) -> set[str]:
        """Read, parse and store these heartbeat keys; the workers taken."""
        table = self._table
        seen: set[str] = set()
        for start in range(0, len(keys), KEYS_PER_READ):
            payloads = await mget(self._redis, keys[start : start + KEYS_PER_READ])
            started = time.thread_time()
            for payload in payloads:
                if payload is None:
                    continue
                view = table.parse(payload, now)
                if view is not None:
                    seen.add(view.worker_id)
                    table.store(view, force=True)
            self._pace.spent(started)
        return seen
