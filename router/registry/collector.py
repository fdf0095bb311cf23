"""Follows heartbeats in Redis and replaces the router's Snapshot as they arrive.

Three paths feed one table of worker views (worker.heartbeat_keys.HeartbeatKeys names them):
- pub/sub on the heartbeat channel: full heartbeats, which agents publish when anything
  but their load changed (a new worker, a state, models...), within milliseconds;
- the regions' load records (router.registry.load_records), read in one round trip as
  often as the snapshot may be rebuilt (every 20 ms for a small fleet, ~1.3-1.5 s for
  10,000 workers): each worker's newest load and order, applied onto the full heartbeat
  it was taken with (the record names it by a digest; when they differ, the worker's key
  is read). ~5-7 us a record taken in, in place (read, parsed, checked, a new view),
  where a heartbeat message cost ~20 us: at 10,000 workers heartbeating at 4 Hz, read
  every ~1.3-1.5 s, ~10% of a core instead of ~78% (BENCHMARKS.md, "Heartbeat plane");
- a full read (SCAN + MGET of the heartbeat keys, router.registry.full_read) at start,
  after every reconnect and every `full_read_interval_s`: repairs anything a lost
  message left out (between two reconnects it parses only the keys of workers not heard
  from since the last one), and doubles as the liveness check of Redis (a blackholed
  server shows up as a timeout here).
Agents that predate load records publish every heartbeat on the channel; those are
followed as before.

Heartbeats that arrive between two snapshot builds are only queued, by worker, and each
worker's newest is parsed and checked when the next snapshot is built
(router.registry.messages).

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
import time
from collections.abc import Callable, Collection

from redis.asyncio import Redis
from redis.exceptions import RedisError

from router.config import DEFAULT_FLEET_VIEW_CPU_SHARE
from router.registry.full_read import FullRead
from router.registry.load_records import LoadRecords
from router.registry.messages import MessageQueue
from router.registry.pace import Pace
from router.registry.publishing import SnapshotPublisher
from router.registry.refusals import Refusals
from router.registry.snapshot import SnapshotHolder
from router.registry.subscriber import Subscription
from router.registry.worker_table import Clock, HeartbeatCheck, WorkerTable
from router.registry.worker_view import WorkerView
from worker.heartbeat_keys import HeartbeatKeys
from worker.redis_client import raise_if_cancelling

log = logging.getLogger("globalpool.registry")

# While Redis stays unreachable, the log says so again this often (s).
UNREACHABLE_LOG_EVERY_S = 10.0
# How often workers past their TTL are looked for, or once per reading interval when that
# is longer (a scan is ~2-5 ms at 10,000 workers; routing skips a stale view before the
# scan takes it out: router.policy.filters).
EXPIRY_CHECK_S = 0.25
# With sharded keys and no list of regions, the channels of at most this many regions
# that the full read finds are followed (what Redis holds need not be bounded).
MAX_FOUND_REGIONS = 256
# Waiting for pub/sub this much longer than asked means this process was not scheduled.
STALL_TOLERANCE_S = 1.0


class _Due:
    """When the loop's next chores are due (on the collector's clock), and whether the
    table may have changed since the last build (`dirty`)."""

    __slots__ = ("dirty", "expiry_check", "full_read", "load_read", "published_at")

    def __init__(self, now: float, full_read_every_s: float) -> None:
        self.full_read = now + full_read_every_s
        self.expiry_check = now + EXPIRY_CHECK_S
        self.load_read = now
        self.published_at = now
        self.dirty = False


class HeartbeatCollector:
    """Owns the worker table (router.registry.worker_table) and the parts that feed it and
    publish it: the only writer of `holder.current`, through its SnapshotPublisher."""

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
        regions: Callable[[], Collection[str]] | None = None,
    ) -> None:
        """`cpu_share`, `agent_interval_s` and `full_read_interval_s`: see Pace.
        `regions`: the regions whose workers it follows (regions.yaml's, following
        reloads), for sharded keys (`keys.sharded`), where each region has its channel;
        None: those the full read finds, at most MAX_FOUND_REGIONS."""
        self._pubsub_redis = pubsub_redis
        self._regions = regions
        self._keys = keys
        self._clock = clock
        self._max_backoff_s = max_backoff_s
        self._pace = Pace(cpu_share=cpu_share, agent_interval_s=agent_interval_s,
                          full_read_interval_s=full_read_interval_s)
        self._refusals = Refusals()
        self._table = WorkerTable(clock=clock, local_inflight=local_inflight, gate=gate,
                                  on_down=on_down, pace=self._pace, refusals=self._refusals)
        self._messages = MessageQueue(table=self._table, gate=gate, refusals=self._refusals)
        self._loads = LoadRecords(redis=redis, keys=keys, table=self._table, pace=self._pace,
                                  gate=gate, refusals=self._refusals)
        self._full_read = FullRead(redis=redis, keys=keys, table=self._table, pace=self._pace,
                                   loads=self._loads)
        self._publisher = SnapshotPublisher(holder=holder, table=self._table,
                                            messages=self._messages, pace=self._pace)
        self.synced = asyncio.Event()
        self._fault: Exception | None = None  # inject_fault
        self._faults_left = 0

    @property
    def rejected_heartbeats(self) -> int:
        """Heartbeats and load records refused, for any reason."""
        return self._refusals.total

    @property
    def received_heartbeats(self) -> int:
        """Messages on the channel (`gone:` ones included)."""
        return self._messages.received

    @property
    def parsed_heartbeats(self) -> int:
        """Heartbeats parsed and checked, of messages and of full reads."""
        return self._table.parsed

    @property
    def read_records(self) -> int:
        """Load records read that had changed since the last read."""
        return self._loads.read_records

    @property
    def applied_records(self) -> int:
        """Load records taken."""
        return self._loads.applied_records

    @property
    def worker_reads(self) -> int:
        """Heartbeat keys read for a record (unknown worker, changed heartbeat)."""
        return self._loads.worker_reads

    @property
    def load_reads(self) -> int:
        """Round trips reading every region's load records."""
        return self._loads.reads

    @property
    def builds(self) -> int:
        """Snapshots built."""
        return self._pace.builds

    def counts(self) -> dict[str, int]:
        """What it has taken in so far (exported as globalpool_* counters), and what it
        refused by reason, as REFUSED_COUNT_PREFIX + reason (router.registry.refusals)."""
        return {"heartbeat_messages": self.received_heartbeats,
                "heartbeats_parsed": self.parsed_heartbeats,
                "heartbeats_malformed": self.rejected_heartbeats,
                "load_records_read": self.read_records,
                "load_records_applied": self.applied_records,
                "heartbeat_key_reads": self.worker_reads,
                "load_record_reads": self.load_reads,
                **self._refusals.counts()}

    @property
    def table(self) -> WorkerTable:
        """The worker table it keeps (router.registry.feed ships it to sibling processes;
        router.registry.mirror fills it from theirs)."""
        return self._table

    @property
    def publisher(self) -> SnapshotPublisher:
        return self._publisher

    @property
    def pace(self) -> Pace:
        return self._pace

    def forget(self) -> None:
        """Forget every worker, record and queued message: the table is about to be filled
        from another process's (router.registry.mirror), and what this one read itself
        must not mix in when it follows Redis again."""
        self._table.views.clear()
        self._table.records.clear()
        self._messages.queued.clear()

    def upkeep(self) -> dict[str, float]:
        """What keeping the fleet view costs: Pace.upkeep."""
        return self._pace.upkeep()

    async def run(self) -> None:
        """Run until cancelled; never raises for Redis trouble (anything else it raises
        is a bug: `router.supervisor` restarts it, after `mark_down`).

        While Redis cannot be reached the log says so at once and every
        UNREACHABLE_LOG_EVERY_S, and the router serves from its last view (fail static)."""
        backoff_s = 0.05
        unreachable_logged_s: float | None = None
        table = self._table
        while True:
            try:
                await self._follow()
            except (RedisError, OSError) as exc:
                raise_if_cancelling()  # shutting down must still stop this loop
                now = self._clock()
                if (unreachable_logged_s is None or table.connected
                        or now - unreachable_logged_s >= UNREACHABLE_LOG_EVERY_S):
                    unreachable_logged_s = now
                    known = len(table.views)
                    log.warning("redis unreachable (%s); %s", _redis_problem(exc),
                                f"serving from the last view of {known} workers (fail static)"
                                if table.last_ok_at_s is not None else
                                "no view of the fleet yet: every request gets 503")
                table.connected = False
                self._publisher.publish()
                await asyncio.sleep(backoff_s)
                backoff_s = min(self._max_backoff_s, backoff_s * 2)
            else:  # _follow returns when the channels to follow change
                backoff_s = 0.05
            if table.connected:
                unreachable_logged_s = None

    def recheck(self) -> None:
        """regions.yaml was reloaded: drop the known workers its rules now refuse (their
        region, model or address taken out) and publish the view without them at once,
        so that the next request already routes by the new file (the loop also notices
        the change by itself, within EXPIRY_CHECK_S)."""
        if self._table.recheck():
            self._publisher.publish()

    def inject_fault(self, exc: Exception, times: int = 1) -> None:
        """Make the loop raise `exc` at its next turn and at the start of its next
        `times - 1` runs: a fault hook, for tests and drills that show a crash is noticed,
        counted and restarted (`router.supervisor`)."""
        self._fault = exc
        self._faults_left = times

    def mark_down(self) -> None:
        """The loop has crashed: publish a view that says it is not being kept (readiness
        fails until the restarted loop has read Redis again)."""
        self._table.connected = False
        self._publisher.publish()

    def _raise_injected_fault(self) -> None:
        fault = self._fault
        if fault is not None:
            self._faults_left -= 1
            if self._faults_left <= 0:
                self._fault = None
            raise fault

    async def _follow(self) -> None:
        """Subscribe, read in full, then follow; returns to subscribe again when the
        channels to follow change (a region added, with sharded keys)."""
        self._raise_injected_fault()
        channels = self._channels()
        async with Subscription(self._pubsub_redis, channels) as subscription:
            await self._connect()
            due = _Due(self._clock(), self._pace.full_read_every_s(len(self._table.views)))
            while channels == self._channels():
                raise_if_cancelling()  # redis-py may have swallowed a cancellation
                self._raise_injected_fault()
                due.dirty |= await self._receive(subscription, due)
                await self._run_due(due)
        log.info("the regions to follow changed: subscribing to %d heartbeat channel(s)",
                 len(self._channels()))

    def _channels(self) -> list[str]:
        """The channels to follow now (see __init__'s `regions`)."""
        keys = self._keys
        if not keys.sharded:
            return keys.channels(())
        if self._regions is not None:
            return keys.channels(self._regions())
        found = self._loads.regions.union(view.region for view in self._table.views.values())
        return keys.channels(sorted(found)[:MAX_FOUND_REGIONS])

    async def _connect(self) -> None:
        """Read the fleet in full (subscribed already: nothing published meanwhile is
        missed), then publish it and say the view is kept."""
        table = self._table
        await self._full_read.run(reconnected=not table.connected)
        if not table.connected:
            log.info("redis connected; %d workers known", len(table.views))
        table.connected = True
        self._publisher.publish()
        self.synced.set()

    async def _receive(self, subscription: Subscription, due: _Due) -> bool:
        """Queue the messages received until the next chore is due. Whether the table may
        have changed."""
        now = self._clock()
        wait_s = max(0.0, min(now + 0.25 if not due.dirty
                              else due.published_at + self._pace.rebuild_every_s,
                              due.load_read) - now)
        waited_from = self._clock()
        payloads = await subscription.get(wait_s)
        overslept_s = self._clock() - waited_from - wait_s
        changed = False
        if overslept_s > STALL_TOLERANCE_S:
            changed |= self._forgive(overslept_s)
        if payloads:
            changed |= self._messages.take(payloads, self._clock())
        return changed

    async def _run_due(self, due: _Due) -> None:
        """The chores that are due: read the load records, read in full, look for expired
        workers, build a snapshot."""
        pace = self._pace
        now = self._clock()
        if now >= due.load_read:
            due.dirty |= await self._read_loads()
            now = self._clock()
            # As often as a snapshot may be built (load must reach the view as fast as
            # messages do: passive health's stall evidence reads it), but not many times
            # per record written.
            due.load_read = now + pace.load_read_every_s()
        if now >= due.full_read:
            started = time.thread_time()
            self._messages.apply()  # older than what the full read finds
            pace.spent(started)
            await self._full_read.run()
            now = self._clock()
            due.full_read = now + pace.full_read_every_s(len(self._table.views))
            due.dirty = True
        if now >= due.expiry_check:
            started = time.thread_time()
            due.dirty |= self._table.recheck()  # (after a reload of regions.yaml)
            due.dirty |= self._table.expire(self._messages.queued)
            pace.spent(started)
            due.expiry_check = now + max(EXPIRY_CHECK_S, pace.rebuild_every_s)
        if due.dirty and now - due.published_at >= pace.rebuild_every_s:
            await self._publisher.publish_in_turns()
            due.published_at = now
            due.dirty = False

    async def _read_loads(self) -> bool:
        """Read every region's load records and apply those that changed. Whether any view
        changed."""
        # Messages first: a new worker's first heartbeat is queued there (its record would
        # otherwise send the router to read its key).
        started = time.thread_time()
        self._messages.apply()
        self._pace.spent(started)
        return await self._loads.read()

    def _forgive(self, stalled_s: float) -> bool:
        """This process was not running for `stalled_s` (its host stalled, or it was
        stopped): no heartbeat could be received meanwhile, so that time does not count
        towards any worker's heartbeat age. Pending messages are applied right after."""
        log.warning("the collector was not scheduled for %.1f s (a stalled host?); "
                    "heartbeat ages exclude that time", stalled_s)
        self._messages.apply()  # received before the stall: aged like the rest
        return self._table.forgive(stalled_s)


def _redis_problem(exc: BaseException) -> str:
    """What went wrong, in one line (redis-py's messages can be long or empty)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__
