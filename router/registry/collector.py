"""Follows heartbeats in Redis and replaces the router's Snapshot as they arrive.

Three paths feed one table of worker views (worker.schema.HeartbeatKeys names them):
- pub/sub on the heartbeat channel: full heartbeats, which agents publish when anything
  but their load changed (a new worker, a state, models...), within milliseconds;
- the regions' load records, read in one round trip as often as the snapshot may be
  rebuilt (every 20 ms for a small fleet, ~1.3-1.5 s for 10,000 workers): each worker's
  newest load and order, applied onto the full heartbeat it was taken with (the record
  names it by a digest; when they differ, the worker's key is read). ~5-7 us a record
  taken in, in place (read, parsed, checked, a new view), where a heartbeat message cost
  ~20 us: at 10,000 workers heartbeating at 4 Hz, read every ~1.3-1.5 s, ~10% of a core
  instead of ~78% (BENCHMARKS.md, "Heartbeat plane");
- a full read (SCAN + MGET of the heartbeat keys) at start, after every reconnect and
  every `full_read_interval_s`: repairs anything a lost message left out (between two
  reconnects it parses only the keys of workers not heard from since the last one), and
  doubles as the liveness check of Redis (a blackholed server shows up as a timeout
  here).
Agents that predate load records publish every heartbeat on the channel; those are
followed as before.

Heartbeats that arrive between two snapshot builds are only queued, by worker, and each
worker's newest is parsed and checked when the next snapshot is built: a large fleet
heartbeats faster than its snapshot is rebuilt (10,000 workers at 4 Hz against a build
every ~0.45 s), and the heartbeats in between would be parsed only to be replaced. The
worker id is read from the payload's bytes to queue it, and must match the id the parsed
heartbeat carries. When a worker has several queued, they are tried newest first by their
own send time and seq (read from the bytes, checked once parsed), not by arrival, until one
is taken: a replay or forgery published after a real report cannot hide it.

Redis unreachable: the table is kept (fail static), the snapshot says
`redis_connected=False`, and the loop reconnects with bounded backoff.

Freshness runs on Redis's clock, not the wall clock: a heartbeat goes stale only when
Redis has delivered something newer (another heartbeat, or a full read) since its TTL ran
out. A Redis that hangs (accepts but never answers, as a partitioned server does) then
cannot age every worker out at once while the collector is still waiting for its read to
time out; one dead worker still ages out, because the others' heartbeats keep that
clock running. After a reconnect, workers that have not re-published yet (Redis came
back empty) keep their place for one TTL from the reconnect instead of being dropped by
the first full read, and time during which the router itself was not running (a stalled
host) does not count towards heartbeat ages either.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Generator
from typing import Protocol

from redis.asyncio import Redis
from redis.exceptions import RedisError

from router.config import DEFAULT_FLEET_VIEW_CPU_SHARE
from router.registry.snapshot import Snapshot, SnapshotHolder, finish
from router.registry.subscriber import Subscription
from router.registry.worker_view import WorkerView
from worker.redis_client import raise_if_cancelling
from worker.schema import (
    SCHEMA_REFUSALS,
    Heartbeat,
    HeartbeatKeys,
    LifecycleState,
    LoadRecord,
    Refused,
    parse_heartbeat,
    record_items,
)

log = logging.getLogger("globalpool.registry")

# While Redis stays unreachable, the log says so again this often (s).
UNREACHABLE_LOG_EVERY_S = 10.0

# A new snapshot at most this often: rebuilding per message would cost O(workers) per
# heartbeat at scale; 20 ms is well below a heartbeat interval. Taking in the load records
# and building cost O(workers) (~60-80 ms for 10,000), so the interval also grows, up to
# MAX_REBUILD_INTERVAL_S, until keeping the view takes the share of a core the router's
# config allows (`router.fleet_view_cpu_share`, 0.1 by default; read at every build, so a
# reload takes effect at once): a 10,000-worker fleet's view then lags its heartbeats by
# ~1-1.5 s (BENCHMARKS.md, "Heartbeat plane"). What is measured (taking in,
# building, freeing, by this thread's CPU time, so a busy machine does not stretch it) is
# ~MEASURED_SHARE of what the router spends on the view (0.72-0.77 in five bench-heartbeats
# runs at 10,000 workers); reading the records (the Redis client parsing the reply, ~1 us a
# record) and the loop around it are the rest, and cannot be told apart from what other
# tasks run meanwhile. The interval is what was measured / (share x MEASURED_SHARE).
MIN_REBUILD_INTERVAL_S = 0.02
MAX_REBUILD_INTERVAL_S = 2.0
MEASURED_SHARE = 0.75
# The interval grows at most this much from one build to the next, so that the next read
# stays within the margin views were given (NEXT_READ_INTERVALS) when a cycle suddenly
# costs more or the share is lowered; it shrinks at once.
MAX_INTERVAL_GROWTH = 1.5
# A worker's next load record is taken at the next read, one interval after this one ends:
# a view stays fresh until then, with a margin (twice the interval plus the slack: the
# next interval is at most MAX_INTERVAL_GROWTH times this one, and the rest is for reading
# and taking in 10,000 records between requests), when that is longer than its TTL
# (snapshot.fresh_for_s): a live worker must not go stale between two reads. Small
# fleets (20 ms) keep their TTL; at 10,000 workers (~1.3-1.5 s) a dead worker with a 1 s
# TTL goes stale within ~4-5 s of its last record instead of ~1.5-2 s.
NEXT_READ_INTERVALS = 2.0
NEXT_READ_SLACK_S = 0.1
# Load records are read at most this many times per agents' heartbeat interval
# (`heartbeat.interval_s`): a small fleet's view would otherwise be rebuilt and its records
# read every 20 ms, 25 reads per record written at 0.5 s, ~3% of a core for a handful of
# workers (BENCHMARKS.md). Reading 10 times per interval adds at most a tenth of it to a
# record's age; messages (state changes, new and departing workers) still reach the view
# at the next build.
LOAD_READS_PER_INTERVAL = 10
# Load records taken in one go before the event loop gets a turn: taking in 10,000 at once
# kept every request waiting ~50 ms (a router's /health answered in up to 63 ms during the
# heartbeat bench); 200 take ~1-2 ms (signed: ~2 ms). A request needs several turns, so
# the chunk counts several times (bench-proxy --only globalpool-fleet: paced TTFT p99 over
# its control +23 ms with 500 a turn, +7 ms with 200).
RECORDS_PER_TURN = 200
# How often workers past their TTL are looked for, or once per reading interval when that
# is longer (a scan is ~2-5 ms at 10,000 workers; routing skips a stale view before the
# scan takes it out: router.policy.filters).
EXPIRY_CHECK_S = 0.25
# Waiting for pub/sub this much longer than asked means this process was not scheduled.
STALL_TOLERANCE_S = 1.0
# A full read of N workers happens at most every N / this many seconds.
FULL_READ_WORKERS_PER_S = 1000.0
# A load record of a worker no router knows (its agent crashed: its key expired, the
# record stayed) is deleted once it is this old.
ORPHAN_RECORD_AGE_S = 300.0

GONE_PREFIX = HeartbeatKeys.GONE_PREFIX.encode()
# Why a heartbeat or load record is refused (counted by reason, `counts`): the schema's
# reasons (worker.schema.SCHEMA_REFUSALS: malformed_json, oversize, unknown_field,
# invalid:<field path>), and what the collector finds once it is parsed. A bounded set,
# never text from the input: each is a label value of globalpool_heartbeats_refused_total.
WORKER_ID_MISMATCH = "worker_id_mismatch"  # not the worker its bytes or hash field name
ORDER_MISMATCH = "order_mismatch"  # sent_at_s and seq read otherwise than they parse
WRONG_REGION = "wrong_region"  # a load record in another region than its worker's
REFUSAL_REASONS = SCHEMA_REFUSALS | {WORKER_ID_MISMATCH, ORDER_MISMATCH, WRONG_REGION}
# counts() names each reason's count so (router.telemetry.metrics labels them).
REFUSED_COUNT_PREFIX = "heartbeats_refused:"
# How a heartbeat's JSON (pydantic's model_dump_json) names its worker: read without parsing.
WORKER_ID_FIELD = b'"worker_id":"'

# Heartbeats waiting for the next build, by worker id (bytes): (payload, received at),
# in the order they arrived.
_Queued = list[tuple[bytes, float]]

Clock = Callable[[], float]
RecordCheck = Callable[[LoadRecord, bytes, WorkerView], "str | None"]


def _order_of(payload: bytes) -> tuple[float, int] | None:
    """(sent_at_s, seq) read from a heartbeat's bytes without parsing it: the last
    occurrence of each (after every nested object) up to the next comma, as both forms
    agents publish write them (other fields follow both); None when they cannot be read
    so. A payload that reads otherwise than it parses is refused (`_apply`)."""
    try:
        sent = payload.rindex(b'"sent_at_s":') + 12
        seq = payload.rindex(b'"seq":') + 6
        return (float(payload[sent : payload.index(b",", sent)]),
                int(payload[seq : payload.index(b",", seq)]))
    except ValueError:
        return None


def _newest_first(candidate: tuple[tuple[float, int] | None, float, bytes]) -> tuple[float, int]:
    return candidate[0] if candidate[0] is not None else (-math.inf, -1)


class HeartbeatCheck(Protocol):
    """Decides whether a well-formed heartbeat is believed (router.registry.heartbeat_gate)."""

    def check(self, heartbeat: Heartbeat, *, via_pubsub: bool,
              payload: bytes | None = None) -> str | None:
        """None to accept, else why it is dropped. `payload`: the bytes it was parsed from."""
        ...

    def check_record(self, record: LoadRecord, payload: bytes, view: WorkerView) -> str | None:
        """The same for a load record (parsed from `payload`) meant for `view`. Asked only
        while `signing`: an unsigned record carries nothing else to check (the worker's
        region and endpoint were checked with its heartbeat)."""
        ...

    @property
    def signing(self) -> bool:
        """Whether heartbeats must be signed (then unsigned `gone:` messages are ignored)."""
        ...


class HeartbeatCollector:
    """Owns the worker table; the only writer of `holder.current`."""

    def __init__(
        self,
        *,
        redis: Redis,
        pubsub_redis: Redis,
        keys: HeartbeatKeys,
        holder: SnapshotHolder,
        clock: Clock = time.monotonic,
        local_inflight: Callable[[str], int] = lambda _worker_id: 0,
        full_read_interval_s: float = 2.0,
        max_backoff_s: float = 2.0,
        gate: HeartbeatCheck | None = None,
        on_down: Callable[[WorkerView], None] = lambda _view: None,
        cpu_share: Callable[[], float] = lambda: DEFAULT_FLEET_VIEW_CPU_SHARE,
        agent_interval_s: Callable[[], float] = lambda: 0.0,
    ) -> None:
        """`agent_interval_s`: how often agents write their records (the config's
        `heartbeat.interval_s`; read at every load read, so a reload takes effect): see
        LOAD_READS_PER_INTERVAL. 0: as often as the view is built."""
        self._redis = redis
        self._gate = gate
        self._on_down = on_down
        self._cpu_share = cpu_share  # see MEASURED_SHARE
        self._agent_interval_s = agent_interval_s
        self._pubsub_redis = pubsub_redis
        self._keys = keys
        self._holder = holder
        self._clock = clock
        self._local_inflight = local_inflight
        self._full_read_interval_s = full_read_interval_s
        self._rebuild_every_s = MIN_REBUILD_INTERVAL_S  # see MEASURED_SHARE
        self._apply_s = 0.0  # what taking in the last load records took
        self._max_backoff_s = max_backoff_s
        self._views: dict[str, WorkerView] = {}
        self._queued: dict[bytes, _Queued] = {}
        self._retired: Snapshot | None = None  # the snapshot last replaced (`_replace`)
        self._released_s = 0.0  # what freeing it took
        # Load records as last read, by region and worker id (bytes): unchanged ones are
        # skipped.
        self._records: dict[str, dict[bytes, bytes]] = {}
        # Records of workers not in the table: (region, sent at), for ORPHAN_RECORD_AGE_S.
        self._orphans: dict[bytes, tuple[str, float]] = {}
        self._wall_clock = time.time
        self._load_regions: set[str] = set()  # regions with load records, as last scanned
        self._connected = False
        self._last_ok_at_s: float | None = None
        self.rejected_heartbeats = 0  # refused, for any reason (the sum of `refusals`)
        self.refusals: dict[str, int] = {}  # by reason (REFUSAL_REASONS)
        self.ignored_gone_messages = 0
        self.received_heartbeats = 0  # messages on the channel (gone: ones included)
        self.parsed_heartbeats = 0  # of those and of full reads: parsed and checked
        self.read_records = 0  # load records read that had changed since the last read
        self.applied_records = 0  # of those: taken
        self.worker_reads = 0  # heartbeat keys read for a record (unknown worker, changed)
        self.load_reads = 0  # round trips reading every region's load records
        # Thread CPU seconds spent parsing, checking and applying what was read, and
        # building snapshots (not the Redis client's reads), and snapshots built.
        self.upkeep_cpu_s = 0.0
        self.builds = 0
        self.synced = asyncio.Event()
        self._fault: Exception | None = None  # inject_fault
        self._faults_left = 0

    def counts(self) -> dict[str, int]:
        """What it has taken in so far (exported as globalpool_* counters), and what it
        refused by reason, as REFUSED_COUNT_PREFIX + reason."""
        return {"heartbeat_messages": self.received_heartbeats,
                "heartbeats_parsed": self.parsed_heartbeats,
                "heartbeats_malformed": self.rejected_heartbeats,
                "load_records_read": self.read_records,
                "load_records_applied": self.applied_records,
                "heartbeat_key_reads": self.worker_reads,
                "load_record_reads": self.load_reads,
                **{REFUSED_COUNT_PREFIX + reason: count
                   for reason, count in self.refusals.items()}}

    def upkeep(self) -> dict[str, float]:
        """What keeping the fleet view costs (exported as globalpool_fleet_view_*): CPU
        seconds so far, snapshots built, and the current least interval between builds."""
        return {"cpu_seconds": self.upkeep_cpu_s, "builds": self.builds,
                "rebuild_interval_seconds": self._rebuild_every_s}

    def _spent(self, started: float) -> float:
        """Thread CPU since `started`, counted as upkeep."""
        spent = time.thread_time() - started
        self.upkeep_cpu_s += spent
        return spent

    async def run(self) -> None:
        """Run until cancelled; never raises for Redis trouble (anything else it raises
        is a bug: `router.supervisor` restarts it, after `mark_down`).

        While Redis cannot be reached the log says so at once and every
        UNREACHABLE_LOG_EVERY_S, and the router serves from its last view (fail static)."""
        backoff_s = 0.05
        unreachable_logged_s: float | None = None
        while True:
            try:
                await self._follow()
            except (RedisError, OSError) as exc:
                raise_if_cancelling()  # shutting down must still stop this loop
                now = self._clock()
                if (unreachable_logged_s is None or self._connected
                        or now - unreachable_logged_s >= UNREACHABLE_LOG_EVERY_S):
                    unreachable_logged_s = now
                    known = len(self._views)
                    log.warning("redis unreachable (%s); %s", _redis_problem(exc),
                                f"serving from the last view of {known} workers (fail static)"
                                if self._last_ok_at_s is not None else
                                "no view of the fleet yet: every request gets 503")
                self._connected = False
                self._publish()
                await asyncio.sleep(backoff_s)
                backoff_s = min(self._max_backoff_s, backoff_s * 2)
            else:  # _follow only returns on cancellation paths; loop defensively
                backoff_s = 0.05
            if self._connected:
                unreachable_logged_s = None

    def inject_fault(self, exc: Exception, times: int = 1) -> None:
        """Make the loop raise `exc` at its next turn and at the start of its next
        `times - 1` runs: a fault hook, for tests and drills that show a crash is noticed,
        counted and restarted (`router.supervisor`)."""
        self._fault = exc
        self._faults_left = times

    def mark_down(self) -> None:
        """The loop has crashed: publish a view that says it is not being kept (readiness
        fails until the restarted loop has read Redis again)."""
        self._connected = False
        self._publish()

    def _raise_injected_fault(self) -> None:
        fault = self._fault
        if fault is not None:
            self._faults_left -= 1
            if self._faults_left <= 0:
                self._fault = None
            raise fault

    async def _follow(self) -> None:
        self._raise_injected_fault()
        async with Subscription(self._pubsub_redis, self._keys.channel) as subscription:
            await self._full_read(reconnected=not self._connected)
            if not self._connected:
                log.info("redis connected; %d workers known", len(self._views))
            self._connected = True
            self._publish()
            self.synced.set()
            now = self._clock()
            next_full_read = now + self._full_read_every_s()
            next_expiry_check = now + EXPIRY_CHECK_S
            next_load_read = now
            published_at = now
            dirty = False
            while True:
                raise_if_cancelling()  # redis-py may have swallowed a cancellation
                self._raise_injected_fault()
                now = self._clock()
                wait_s = max(0.0, min(now + 0.25 if not dirty
                                      else published_at + self._rebuild_every_s,
                                      next_load_read) - now)
                waited_from = self._clock()
                payloads = await subscription.get(wait_s)
                overslept_s = self._clock() - waited_from - wait_s
                if overslept_s > STALL_TOLERANCE_S:
                    dirty |= self._forgive(overslept_s)
                if payloads:
                    received_s = self._clock()
                    self.received_heartbeats += len(payloads)
                    for payload in payloads:
                        dirty |= self._queue_message(payload, received_s)
                now = self._clock()
                if now >= next_load_read:
                    dirty |= await self._read_loads()
                    now = self._clock()
                    # As often as a snapshot may be built (load must reach the view as
                    # fast as messages do: passive health's stall evidence reads it), but
                    # not many times per record written.
                    next_load_read = now + self._load_read_every_s()
                if now >= next_full_read:
                    started = time.thread_time()
                    self._apply_queued()  # older than what the full read finds
                    self._spent(started)
                    await self._full_read()
                    now = self._clock()
                    next_full_read = now + self._full_read_every_s()
                    dirty = True
                if now >= next_expiry_check:
                    started = time.thread_time()
                    dirty |= self._expired_any()
                    self._spent(started)
                    next_expiry_check = now + max(EXPIRY_CHECK_S, self._rebuild_every_s)
                if dirty and now - published_at >= self._rebuild_every_s:
                    await self._publish_in_turns()
                    published_at = now
                    dirty = False

    def _load_read_every_s(self) -> float:
        return max(self._rebuild_every_s, self._agent_interval_s() / LOAD_READS_PER_INTERVAL)

    def _next_read_s(self) -> float:
        """The longest until the load records are read again (see NEXT_READ_INTERVALS)."""
        return NEXT_READ_INTERVALS * self._load_read_every_s() + NEXT_READ_SLACK_S

    def _full_read_every_s(self) -> float:
        """Large fleets are read in full less often: pub/sub carries the updates anyway."""
        return max(self._full_read_interval_s, len(self._views) / FULL_READ_WORKERS_PER_S)

    async def _full_read(self, *, reconnected: bool = False) -> None:
        keys: list[bytes] = []
        async for key in self._redis.scan_iter(match=self._keys.pattern, count=1000):
            keys.append(key)
        regions: set[str] = set()
        loads_at = len(self._keys.loads("").encode())
        async for key in self._redis.scan_iter(match=self._keys.loads_pattern, count=1000):
            regions.add(key[loads_at:].decode(errors="replace"))
        self._load_regions = regions
        now = self._clock()
        if not reconnected:
            # Workers this router heard from since the last full read (a message or a load
            # record, which are newer than their key) need not be parsed again: what is
            # left to repair is a worker it does not know or has not heard from.
            since_s = now - self._full_read_every_s()
            views = self._views
            worker_at = len(self._keys.worker("").encode())
            keys = [key for key in keys
                    if (view := views.get(key[worker_at:].decode(errors="replace"))) is None
                    or view.received_at_s < since_s]
        seen: set[str] = set()
        for start in range(0, len(keys), 500):
            payloads = await self._redis.mget(keys[start : start + 500])
            started = time.thread_time()
            for payload in payloads:
                if payload is None:
                    continue
                view = self._parse(payload, now)
                if view is not None:
                    seen.add(view.worker_id)
                    self._store(view, force=True)
            self._spent(started)
        # A worker whose key is missing is not dropped here: a deleted one said `gone:`,
        # and any other ages out by its TTL on this collector's clock (see the module
        # doc). Redis's own key expiry cannot be trusted for that: after Redis restarts
        # empty, or after a stall of Redis's host, keys are missing although their workers
        # are alive and about to re-publish.
        if reconnected:
            # Redis may have come back empty: a worker that has not re-published yet keeps
            # its place for one TTL from now; its next heartbeat, or expiry, settles it.
            next_read_s = self._next_read_s()
            for worker_id in [w for w in self._views if w not in seen]:
                self._views[worker_id] = self._views[worker_id].received_again(
                    now, next_read_s)
        self._last_ok_at_s = self._clock()

    async def _read_loads(self) -> bool:
        """Read every region's load records in one round trip and apply those that
        changed (see the module doc). Whether any view changed."""
        # Messages first: a new worker's first heartbeat is queued there (its record would
        # otherwise send the router to read its key).
        started = time.thread_time()
        self._apply_queued()
        self._spent(started)
        regions = sorted(self._load_regions.union(view.region for view in self._views.values()))
        if not regions:
            return False
        self.load_reads += 1
        async with self._redis.pipeline(transaction=False) as pipe:
            for region in regions:
                pipe.hgetall(self._keys.loads(region))
            replies = await pipe.execute()
        started = time.thread_time()
        now = self._clock()
        self._last_ok_at_s = now  # Redis answered: its clock runs (module doc)
        to_read: list[str] = []
        changed = False
        gate = self._gate  # asked once a read: whether records go to it (HeartbeatCheck)
        check = gate.check_record if gate is not None and gate.signing else None
        next_read_s = self._next_read_s()
        self._apply_s = 0.0
        taken = 0
        for region, records in zip(regions, replies, strict=True):
            seen = self._records.setdefault(region, {})
            for worker, payload in records.items():
                if seen.get(worker) == payload:
                    continue
                seen[worker] = payload
                changed |= self._apply_record(region, worker, payload, now, to_read, check,
                                              next_read_s)
                taken += 1
                if taken % RECORDS_PER_TURN == 0:
                    # Requests wait while this runs: let them through (see RECORDS_PER_TURN).
                    self._apply_s += self._spent(started)
                    await asyncio.sleep(0)
                    started = time.thread_time()
        self._apply_s += self._spent(started)
        if to_read:
            changed |= await self._read_workers(to_read)
        if self._orphans:
            await self._delete_orphans()
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
        RecordItems). `next_read_s`: see NEXT_READ_INTERVALS."""
        self.read_records += 1
        try:
            record = record_items(payload)
        except Refused as exc:
            self._refuse(exc.reason, f"load record {worker[:60]!r} in region "
                                     f"{region[:60]!r}: {exc}")
            return False
        worker_id, seq, sent_at_s = record[1], record[2], record[3]
        if worker_id.encode() != worker:
            self._refuse(WORKER_ID_MISMATCH, f"load record {worker[:60]!r} in region "
                                             f"{region[:60]!r} names worker {worker_id[:60]!r}")
            return False
        view = self._views.get(worker_id)
        if view is None:
            self._orphans[worker] = (region, sent_at_s)  # deleted if it stays so
            to_read.append(worker_id)
            return False
        if view.region != region:
            self._refuse(WRONG_REGION, f"load record of {worker_id!r} in region "
                                       f"{region[:60]!r}, but it heartbeats in {view.region!r}")
            return False
        if record[4] != view.static_digest:
            to_read.append(worker_id)  # more than its load changed, and no message came
            return False
        if sent_at_s < view.sent_at_s or (sent_at_s == view.sent_at_s and seq <= view.seq):
            return False  # not newer than what the router has (a replay, or no news)
        if check is not None and check(LoadRecord.of(record), payload, view):
            return False  # unsigned, forged or stale: counted by the gate
        self._views[worker_id] = view.with_load(record, now, self._local_inflight(worker_id),
                                                next_read_s)
        self.applied_records += 1
        return True

    async def _read_workers(self, worker_ids: list[str]) -> bool:
        """Read these workers' heartbeat keys (see `_apply_record`)."""
        self.worker_reads += len(worker_ids)
        payloads = await self._redis.mget([self._keys.worker(w) for w in worker_ids])
        started = time.thread_time()
        now = self._clock()
        changed = False
        for payload in payloads:
            if payload is not None:
                view = self._parse(payload, now)
                changed |= view is not None and self._store(view, force=False)
        self._spent(started)
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
        for worker, (region, sent_at_s) in self._orphans.items():
            if worker.decode(errors="replace") in views:
                continue
            if sent_at_s < cutoff:
                old.append((worker, region))
            else:
                unknown[worker] = (region, sent_at_s)
        self._orphans = unknown
        if old:
            async with self._redis.pipeline(transaction=False) as pipe:
                for worker, region in old:
                    pipe.hdel(self._keys.loads(region), worker)
                    self._records.get(region, {}).pop(worker, None)
                await pipe.execute()
            log.info("deleted %d load records of workers unheard of for %.0f s",
                     len(old), ORPHAN_RECORD_AGE_S)

    def _queue_message(self, payload: bytes, received_s: float) -> bool:
        """Queue a heartbeat for the next build (see the module doc); a `gone:` message
        takes effect now. Whether anything may have changed."""
        if payload.startswith(GONE_PREFIX):
            if self._gate is not None and self._gate.signing:
                # `gone:` carries no signature: anyone allowed to PUBLISH could remove any
                # worker with it. With signing on, a departed worker ages out by its TTL
                # instead (its last, signed, heartbeat already said `draining`).
                self.ignored_gone_messages += 1
                return False
            worker = payload[len(GONE_PREFIX):]
            self._queued.pop(worker, None)  # it said gone after these
            view = self._views.pop(worker.decode(errors="replace"), None)
            if view is None:
                return False
            self._records.get(view.region, {}).pop(worker, None)
            return True
        start = payload.find(WORKER_ID_FIELD)
        if start < 0:  # not as a worker writes one: parsed now, to be refused and counted
            return self._apply(payload, received_s, None, None)
        start += len(WORKER_ID_FIELD)
        worker = payload[start : payload.find(b'"', start)]
        waiting = self._queued.get(worker)
        if waiting is None:
            self._queued[worker] = [(payload, received_s)]
        else:
            waiting.append((payload, received_s))
        self._last_ok_at_s = received_s  # Redis delivered: its clock runs (module doc)
        return True

    def _apply_queued(self) -> None:
        """Parse and store each queued worker's newest heartbeat that is taken."""
        queued, self._queued = self._queued, {}
        for worker, waiting in queued.items():
            if len(waiting) == 1:  # one heartbeat since the last build
                payload, received_s = waiting[0]
                self._apply(payload, received_s, worker, None)
                continue
            # Several: by their own order (send time, then seq), as read from the bytes and
            # checked once parsed, not by arrival: a replay published after the real report
            # is then tried only if that report is not taken.
            candidates = [(_order_of(payload), received_s, payload)
                          for payload, received_s in reversed(waiting)]
            candidates.sort(key=_newest_first, reverse=True)
            for order, received_s, payload in candidates:
                if self._apply(payload, received_s, worker, order):
                    break

    def _apply(self, payload: bytes, received_s: float, worker: bytes | None,
               order: tuple[float, int] | None) -> bool:
        view = self._parse(payload, received_s, via_pubsub=True)
        if view is None:
            return False
        heartbeat = view.heartbeat
        if worker is not None and heartbeat.worker_id.encode() != worker:
            self._refuse(WORKER_ID_MISMATCH, f"worker id {heartbeat.worker_id!r} does not "
                         f"match the payload's first worker_id field ({worker[:60]!r})")
            return False
        if order is not None and (heartbeat.sent_at_s, heartbeat.seq) != order:
            self._refuse(ORDER_MISMATCH, f"sent_at_s and seq of {heartbeat.worker_id!r} do "
                         "not match the payload's last such fields")
            return False
        self._last_ok_at_s = max(self._last_ok_at_s or received_s, received_s)
        return self._store(view, force=False)

    def _parse(
        self, payload: str | bytes, now: float, *, via_pubsub: bool = False
    ) -> WorkerView | None:
        self.parsed_heartbeats += 1
        try:
            heartbeat = parse_heartbeat(payload)
        except Refused as exc:
            self._refuse(exc.reason, str(exc))
            return None
        if self._gate is not None and self._gate.check(
                heartbeat, via_pubsub=via_pubsub,
                payload=payload.encode() if isinstance(payload, str) else payload):
            return None  # unsigned, forged, replayed or from a disallowed address: counted
        return WorkerView(
            heartbeat=heartbeat,
            received_at_s=now,
            inflight_at_receipt=self._local_inflight(heartbeat.worker_id),
            next_read_s=self._next_read_s(),  # its records come at the reads
        )

    def _refuse(self, reason: str, why: str) -> None:
        """Count a refused heartbeat or load record by `reason` (REFUSAL_REASONS)."""
        self.rejected_heartbeats += 1
        self.refusals[reason] = self.refusals.get(reason, 0) + 1
        count = self.rejected_heartbeats
        if count & (count - 1) == 0:  # 1st, 2nd, 4th, 8th...: garbage cannot flood logs
            log.warning("refused a heartbeat or load record (%s; %d so far): %s",
                        reason, count, why)

    def _store(self, view: WorkerView, *, force: bool) -> bool:
        current = self._views.get(view.worker_id)
        if current is not None and not view.newer_than(current):
            if not force or current.seq != view.seq:
                return False
            view = current  # same report seen again via a full read: keep its receipt time
        elif (current is not None and view.heartbeat.state is LifecycleState.DEGRADED
              and current.heartbeat.state is LifecycleState.READY):
            self._on_down(view)
        self._views[view.worker_id] = view
        return True

    def _forgive(self, stalled_s: float) -> bool:
        """This process was not running for `stalled_s` (its host stalled, or it was
        stopped): no heartbeat could be received meanwhile, so that time does not count
        towards any worker's heartbeat age. Pending messages are applied right after."""
        log.warning("the collector was not scheduled for %.1f s (a stalled host?); "
                    "heartbeat ages exclude that time", stalled_s)
        self._apply_queued()  # received before the stall: aged like the rest
        now = self._clock()
        next_read_s = self._next_read_s()
        for worker_id, view in self._views.items():
            self._views[worker_id] = view.received_again(
                min(now, view.received_at_s + stalled_s), next_read_s)
        return bool(self._views)

    def _expired_any(self) -> bool:
        if not self._connected or self._last_ok_at_s is None:
            return False
        now = min(self._clock(), self._last_ok_at_s)  # Redis's clock: see the module doc
        queued = self._queued  # a newer heartbeat waits for the next build: not expired
        expired = [w for w, v in self._views.items()  # v.fresh(now), inline: 10,000 x 4 Hz
                   if v.expires_at_s <= now and w.encode() not in queued]
        for worker_id in expired:
            view = self._views.pop(worker_id)
            self._records.get(view.region, {}).pop(worker_id.encode(), None)
        return bool(expired)

    def _publish(self) -> None:
        """Build and publish a snapshot at once (when the collector starts or loses Redis;
        while it follows the fleet, `_publish_in_turns`)."""
        started = time.thread_time()
        self._apply_queued()
        self._replace(finish(self._build_steps()), self._spent(started))
        started = time.thread_time()
        self._retired = None
        self._released_s = self._spent(started)

    async def _publish_in_turns(self) -> None:
        """Build and publish a snapshot with the event loop running between the build's
        steps, and free the one it replaces after another turn: a fleet of 10,000 takes
        ~10-20 ms to build and ~10 ms to free, and requests would wait for all of it. The
        thread CPU of the parts is summed (not the other tasks' in between)."""
        started = time.thread_time()
        self._apply_queued()
        steps = self._build_steps()
        cost_s = 0.0
        while True:
            try:
                next(steps)
            except StopIteration as done:
                snapshot: Snapshot = done.value
                break
            cost_s += self._spent(started)
            await asyncio.sleep(0)
            started = time.thread_time()
        self._replace(snapshot, cost_s + self._spent(started))
        await asyncio.sleep(0)
        started = time.thread_time()
        self._retired = None
        self._released_s = self._spent(started)

    def _build_steps(self) -> Generator[None, None, Snapshot]:
        """The build of a snapshot of the table as it is now (Snapshot.build_in_steps)."""
        return Snapshot.build_in_steps(self._views.values(), built_at_s=self._clock(),
                                       redis_connected=self._connected,
                                       last_redis_ok_at_s=self._last_ok_at_s)

    def _replace(self, snapshot: Snapshot, cost_s: float) -> None:
        """Make `snapshot` current (the one it replaces is kept in `_retired`, for the
        caller to free), and pace the next build by what this one took."""
        self._retired = self._holder.current
        self._holder.current = snapshot
        self.builds += 1
        cost_s += self._apply_s + self._released_s  # the last one freed: a cost of building
        self._rebuild_every_s = min(
            MAX_REBUILD_INTERVAL_S, MAX_INTERVAL_GROWTH * self._rebuild_every_s,
            max(MIN_REBUILD_INTERVAL_S, cost_s / (self._cpu_share() * MEASURED_SHARE)))


def _redis_problem(exc: BaseException) -> str:
    """What went wrong, in one line (redis-py's messages can be long or empty)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__
