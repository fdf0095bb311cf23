"""The heartbeat collector against a real Valkey that hangs, dies and comes back empty.

Each test owns its Valkey (it is stopped, frozen with SIGSTOP or replaced); the
collector runs in the test's loop, workers publish through the real publisher.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator

import pytest

from lab.devstack.valkey import EmbeddedValkey
from router.core.stats import SecurityStats
from router.registry import HeartbeatCollector, SnapshotHolder
from router.registry import collector as collector_module
from router.registry import pace as pace_module
from router.registry.heartbeat_gate import HeartbeatGate, HeartbeatRules
from router.registry.subscriber import Subscription
from worker.heartbeat_keys import HeartbeatKeys
from worker.load_records import load_record
from worker.publisher import HeartbeatPublisher
from worker.redis_client import connect, connect_pubsub
from worker.schema import Capacity, Heartbeat, LifecycleState, Load
from worker.signing import HeartbeatSigner

TTL_S = 1.0
KEYS = HeartbeatKeys("gptest-collector")


@pytest.fixture
def valkey() -> Iterator[EmbeddedValkey]:
    server = EmbeddedValkey.start()
    try:
        yield server
    finally:
        with contextlib.suppress(ProcessLookupError):
            server.process.send_signal(signal.SIGCONT)
        server.stop()


class Fleet:
    """Workers publishing heartbeats, and a collector following them."""

    def __init__(self, url: str, clock: Callable[[], float],
                 signer: HeartbeatSigner | None = None) -> None:
        self.url = url
        self.clock = clock
        self.holder = SnapshotHolder()
        self.downs: list[str] = []
        self.seq = 0
        self.signer = signer
        self.collector: HeartbeatCollector | None = None
        self.stats = SecurityStats()
        self.publisher = HeartbeatPublisher(connect(url), KEYS, signer=signer)

    def beat(self, worker_id: str, state: LifecycleState = LifecycleState.READY) -> Heartbeat:
        self.seq += 1
        return Heartbeat(worker_id=worker_id, region="us-east",
                         endpoint=f"http://127.0.0.1:1/{worker_id}", models=("m",),
                         state=state, capacity=Capacity(max_num_seqs=8),
                         load=Load(running=0, waiting=0, kv_cache_usage=0.0),
                         seq=self.seq, sent_at_s=time.time(), ttl_s=TTL_S)

    async def publish(self, *worker_ids: str,
                      state: LifecycleState = LifecycleState.READY) -> None:
        for worker_id in worker_ids:
            await self.publisher.publish(self.beat(worker_id, state))

    async def keep_publishing(self, *worker_ids: str) -> None:
        while True:
            with contextlib.suppress(Exception):
                await self.publish(*worker_ids)
            await asyncio.sleep(0.1)

    def fresh(self) -> set[str]:
        snapshot = self.holder.current
        now_s = snapshot.freshness_now(self.clock())
        return {w for w, view in snapshot.workers.items() if view.fresh(now_s)}

    def connected(self) -> bool:
        return self.holder.current.redis_connected


SECRET = b"a-test-secret-of-at-least-32-bytes!!"


@contextlib.asynccontextmanager
async def following(url: str, clock: Callable[[], float] = time.monotonic, *,
                    signed: bool = False, agent_interval_s: float = 0.0,
                    ) -> AsyncIterator[Fleet]:
    fleet = Fleet(url, clock, HeartbeatSigner("k1", SECRET) if signed else None)
    gate = HeartbeatGate(keys={"k1": SECRET}, rules=HeartbeatRules,
                         stats=fleet.stats) if signed else None
    collector = HeartbeatCollector(
        redis=connect(url), pubsub_redis=connect_pubsub(url), keys=KEYS, holder=fleet.holder,
        full_read_interval_s=2.0, clock=clock, gate=gate,
        on_down=lambda view: fleet.downs.append(view.worker_id),
        agent_interval_s=lambda: agent_interval_s,
    )
    fleet.collector = collector
    task = asyncio.create_task(collector.run())
    try:
        async with asyncio.timeout(5.0):
            await collector.synced.wait()
        yield fleet
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await fleet.publisher.aclose()


async def until(condition: object, timeout_s: float = 10.0) -> None:
    assert callable(condition)
    async with asyncio.timeout(timeout_s):
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.02)


async def test_a_hung_redis_keeps_every_worker_fresh(valkey: EmbeddedValkey) -> None:
    async with following(valkey.url) as fleet:
        publishing = asyncio.create_task(fleet.keep_publishing("a", "b"))
        try:
            await until(lambda: fleet.fresh() == {"a", "b"})
            valkey.process.send_signal(signal.SIGSTOP)  # accepts, never answers
            await asyncio.sleep(3 * TTL_S)  # every heartbeat's TTL has run out meanwhile
            assert fleet.fresh() == {"a", "b"}, "fail static, also before the hang is noticed"
            await until(lambda: not fleet.connected(), timeout_s=10.0)
            valkey.process.send_signal(signal.SIGCONT)
            await until(fleet.connected)
            assert fleet.fresh() == {"a", "b"}
        finally:
            publishing.cancel()
            await asyncio.gather(publishing, return_exceptions=True)


async def test_one_silent_worker_ages_out_while_the_others_publish(
    valkey: EmbeddedValkey,
) -> None:
    async with following(valkey.url) as fleet:
        await fleet.publish("quiet")
        publishing = asyncio.create_task(fleet.keep_publishing("a"))
        try:
            await until(lambda: fleet.fresh() == {"a", "quiet"})
            started = time.monotonic()
            await until(lambda: fleet.fresh() == {"a"}, timeout_s=5.0)
            assert time.monotonic() - started < TTL_S + 0.5
        finally:
            publishing.cancel()
            await asyncio.gather(publishing, return_exceptions=True)


async def test_workers_survive_redis_coming_back_empty(valkey: EmbeddedValkey) -> None:
    async with following(valkey.url) as fleet:
        await fleet.publish("a", "b")
        await until(lambda: fleet.fresh() == {"a", "b"})
        port = valkey.port
        valkey.stop()
        await until(lambda: not fleet.connected())
        replacement = EmbeddedValkey.start(port=port)  # same address, no data
        try:
            await until(fleet.connected)
            # The first full read found no key: neither worker has re-published yet.
            assert fleet.fresh() == {"a", "b"}
            publishing = asyncio.create_task(fleet.keep_publishing("a"))
            try:
                await until(lambda: fleet.fresh() == {"a"}, timeout_s=TTL_S + 3.0)
            finally:
                publishing.cancel()
                await asyncio.gather(publishing, return_exceptions=True)
        finally:
            replacement.stop()


async def test_a_worker_turning_degraded_is_reported_down_once(valkey: EmbeddedValkey) -> None:
    async with following(valkey.url) as fleet:
        await fleet.publish("a")
        await until(lambda: "a" in fleet.holder.current.workers)
        for _ in range(3):
            await fleet.publish("a", state=LifecycleState.DEGRADED)
        await until(lambda: fleet.holder.current.workers["a"].heartbeat.state
                    is LifecycleState.DEGRADED)
        await fleet.publish("a")
        await until(lambda: fleet.holder.current.workers["a"].ready)
        assert fleet.downs == ["a"]


async def test_time_the_router_was_not_running_does_not_age_heartbeats(
    valkey: EmbeddedValkey,
) -> None:
    # The whole host stalls (a VM descheduled): nobody published, nobody received. The
    # collector's clock jumps; the workers are not thereby dead.
    jumped = [0.0]
    async with following(valkey.url, clock=lambda: time.monotonic() + jumped[0]) as fleet:
        await fleet.publish("a", "b")
        await until(lambda: fleet.fresh() == {"a", "b"})
        jumped[0] = 5 * TTL_S
        await asyncio.sleep(0.6)  # the collector notices on its next wake-up
        assert fleet.fresh() == {"a", "b"}
        await asyncio.sleep(TTL_S + 0.5)  # but silence after the stall still counts
        await fleet.publish("a")
        await until(lambda: fleet.fresh() == {"a"})


async def test_gone_removes_at_once_unless_heartbeats_must_be_signed(
    valkey: EmbeddedValkey,
) -> None:
    async with following(valkey.url) as fleet:
        await fleet.publish("a")
        await until(lambda: fleet.fresh() == {"a"})
        await fleet.publisher.remove("a")  # DEL + PUBLISH gone:a, as a drained agent does
        await until(lambda: "a" not in fleet.holder.current.workers, timeout_s=0.5)
    async with following(valkey.url, signed=True) as fleet:
        await fleet.publish("b")
        await until(lambda: fleet.fresh() == {"b"})
        # `gone:` is not signed: anyone who may PUBLISH could send it. Ignored; the worker
        # ages out by its TTL instead.
        redis = connect(valkey.url)
        try:
            await redis.publish(KEYS.channel, KEYS.gone_message("b"))
        finally:
            await redis.aclose()
        await asyncio.sleep(0.3)
        assert "b" in fleet.holder.current.workers


async def test_a_subscription_redis_cuts_is_reopened_and_garbage_on_it_is_dropped(
    valkey: EmbeddedValkey,
) -> None:
    admin = connect(valkey.url)
    async with following(valkey.url) as fleet:
        await fleet.publish("a")
        await until(lambda: fleet.fresh() == {"a"})
        for garbage in (b"not json", b"\xff\xfe", b'{"worker_id": "x"}', b"[]"):
            await admin.publish(KEYS.channel, garbage)
        # What Valkey does to a subscriber that falls behind (output buffer limit).
        assert await admin.client_kill_filter(_type="pubsub") == 1
        await fleet.publish("b")  # may be lost with the subscription: the full read has it
        await until(lambda: fleet.fresh() == {"a", "b"}, timeout_s=5.0)
        await fleet.publish("a", state=LifecycleState.DRAINING)  # the new subscription
        await until(lambda: fleet.holder.current.workers["a"].heartbeat.state
                    is LifecycleState.DRAINING, timeout_s=1.0)  # before a full read
        assert fleet.connected()
    await admin.aclose()


async def test_subscribing_to_a_hung_redis_fails_in_seconds(valkey: EmbeddedValkey) -> None:
    from redis.exceptions import ConnectionError as RedisConnectionError

    from router.registry.subscriber import SUBSCRIBE_TIMEOUT_S, Subscription

    client = connect_pubsub(valkey.url)
    valkey.process.send_signal(signal.SIGSTOP)  # accepts connections, never answers
    started = time.monotonic()
    with pytest.raises(RedisConnectionError, match="did not confirm"):
        async with Subscription(client, KEYS.channel):
            pass
    assert time.monotonic() - started < SUBSCRIBE_TIMEOUT_S + 1.0
    valkey.process.send_signal(signal.SIGCONT)
    publisher = connect(valkey.url)
    async with Subscription(client, KEYS.channel) as subscription:
        await publisher.publish(KEYS.channel, b"hello")
        assert await subscription.get(2.0) == [b"hello"]
    await publisher.aclose()
    await client.aclose()


async def test_heartbeats_between_two_builds_are_parsed_once_per_worker(
    valkey: EmbeddedValkey,
) -> None:
    admin = connect(valkey.url)
    async with following(valkey.url) as fleet:
        collector = fleet.collector
        assert collector is not None
        await fleet.publish("a", "b")
        await until(lambda: fleet.fresh() == {"a", "b"})
        received, parsed = collector.received_heartbeats, collector.parsed_heartbeats
        # 100 reports per worker in one burst (pipelined: they arrive together), the
        # last of each worker's says draining.
        async with admin.pipeline(transaction=False) as pipe:
            for n in range(100):
                for worker_id in ("a", "b"):
                    state = LifecycleState.DRAINING if n == 99 else LifecycleState.READY
                    pipe.publish(KEYS.channel, fleet.beat(worker_id, state).to_json())
            await pipe.execute()
        await until(lambda: all(view.heartbeat.state is LifecycleState.DRAINING
                                for view in fleet.holder.current.workers.values()))
        await until(lambda: collector.received_heartbeats - received == 200)
        # Each worker's newest is what counts: far fewer parsed than received.
        assert collector.parsed_heartbeats - parsed <= 40
        assert collector.rejected_heartbeats == 0
    await admin.aclose()


async def test_a_replay_queued_after_the_newest_heartbeat_does_not_hide_it(
    valkey: EmbeddedValkey,
) -> None:
    admin = connect(valkey.url)
    async with following(valkey.url, signed=True) as fleet:
        assert fleet.signer is not None
        old = fleet.signer.sign(fleet.beat("a")).to_json()
        await admin.publish(KEYS.channel, old)
        await until(lambda: fleet.fresh() == {"a"})
        captured = fleet.signer.sign(fleet.beat("a")).to_json()  # never delivered
        newest = fleet.signer.sign(fleet.beat("a", LifecycleState.DRAINING)).to_json()
        # Whoever may PUBLISH sends, right after the newest (one burst: all wait for the
        # same build), a captured report newer than the one the router has but older than
        # the newest, the old one again, and another worker's signed report with "a"
        # slipped in as its first worker_id field (JSON's last one counts).
        other = fleet.signer.sign(fleet.beat("c")).to_json()
        disguised = other.replace("{", '{"worker_id":"a",', 1)
        async with admin.pipeline(transaction=False) as pipe:
            pipe.publish(KEYS.channel, newest)
            pipe.publish(KEYS.channel, captured)
            pipe.publish(KEYS.channel, old)
            pipe.publish(KEYS.channel, disguised)
            await pipe.execute()
        await until(lambda: fleet.holder.current.workers["a"].heartbeat.state
                    is LifecycleState.DRAINING)
        await asyncio.sleep(0.2)
        assert fleet.holder.current.workers["a"].heartbeat.state is LifecycleState.DRAINING
        assert set(fleet.holder.current.workers) == {"a"}  # the disguised one is dropped
        assert fleet.collector is not None and fleet.collector.rejected_heartbeats == 1
    await admin.aclose()


def with_load(heartbeat: Heartbeat, running: int) -> Heartbeat:
    return heartbeat.model_copy(update={"load": Load(running=running, waiting=0,
                                                     kv_cache_usage=0.5)})


async def test_routine_heartbeats_arrive_as_load_records_and_changes_as_messages(
    valkey: EmbeddedValkey,
) -> None:
    watcher = connect_pubsub(valkey.url)
    async with following(valkey.url) as fleet, Subscription(watcher, KEYS.channel) as channel:
        collector = fleet.collector
        assert collector is not None
        await fleet.publish("a")
        await until(lambda: fleet.fresh() == {"a"})
        parsed = collector.parsed_heartbeats
        for running in range(1, 6):
            await fleet.publisher.publish(with_load(fleet.beat("a"), running))
            await until(lambda r=running: fleet.holder.current.workers["a"].running == r)
        await fleet.publish("a", state=LifecycleState.DRAINING)
        await until(lambda: fleet.holder.current.workers["a"].heartbeat.state
                    is LifecycleState.DRAINING)
        # The channel carried the first heartbeat and the change of state; the five
        # in between reached the router as load records, parsed as nothing else.
        messages = await channel.get(1.0)
        assert [Heartbeat.from_json(m).state for m in messages] == [
            LifecycleState.READY, LifecycleState.DRAINING]
        assert collector.applied_records >= 5
        assert collector.parsed_heartbeats - parsed <= 2  # the draining one, + a full read
        view = fleet.holder.current.workers["a"]
        assert (view.running, view.kv_cache_usage) == (0, 0.0)  # the draining heartbeat's
        # Leaving removes the key and the load record, and says so on the channel.
        admin = connect(valkey.url)
        assert await admin.hexists(KEYS.loads("us-east"), "a")
        await fleet.publisher.remove("a")
        assert await channel.get(1.0) == [b"gone:a"]
        assert not await admin.hexists(KEYS.loads("us-east"), "a")
        assert not await admin.exists(KEYS.worker("a"))
        await admin.aclose()
    await watcher.aclose()


async def test_a_change_whose_message_was_lost_is_read_from_the_workers_key(
    valkey: EmbeddedValkey,
) -> None:
    admin = connect(valkey.url)
    async with following(valkey.url) as fleet:
        await fleet.publish("a")
        await until(lambda: fleet.fresh() == {"a"})
        # What an agent writes, without the messages (lost: the subscription was cut):
        # "a" starts draining; "b" is new.
        for heartbeat in (fleet.beat("a", LifecycleState.DRAINING), fleet.beat("b")):
            async with admin.pipeline(transaction=True) as pipe:
                pipe.set(KEYS.worker(heartbeat.worker_id), heartbeat.to_json(), px=1000)
                pipe.hset(KEYS.loads("us-east"), heartbeat.worker_id, load_record(heartbeat))
                await pipe.execute()
        # Well before the next full read (every 2 s): from the records' digests.
        await until(lambda: fleet.fresh() == {"a", "b"}
                    and fleet.holder.current.workers["a"].heartbeat.state
                    is LifecycleState.DRAINING, timeout_s=1.5)
    await admin.aclose()


async def test_load_records_that_are_not_the_workers_own_are_dropped(
    valkey: EmbeddedValkey,
) -> None:
    admin = connect(valkey.url)
    async with following(valkey.url, signed=True) as fleet:
        collector, signer = fleet.collector, fleet.signer
        assert collector is not None and signer is not None

        def lasting(worker_id: str, **changes: object) -> Heartbeat:
            # A TTL that outlasts the test: the workers publish only once here.
            return fleet.beat(worker_id).model_copy(update={"ttl_s": 30.0, **changes})

        for worker_id in ("a", "b"):
            await fleet.publisher.publish(lasting(worker_id))
        await until(lambda: fleet.fresh() == {"a", "b"})
        await until(lambda: collector.read_records >= 2)
        rejected = collector.rejected_heartbeats

        async def write(region: str, field: str, record: bytes) -> None:
            # The count before the write: the collector's read that finds the record can
            # be answered, and counted, before this coroutine resumes after its HSET.
            read = collector.read_records
            await admin.hset(KEYS.loads(region), field, record)
            await until(lambda: collector.read_records > read)

        busy = with_load(signer.sign(lasting("a")), 8)
        await write("us-east", "a", load_record(busy))  # unsigned
        assert fleet.stats.heartbeats_dropped["unsigned"] == 1
        forged = signer.signed_record(load_record(busy)).replace(b",8,0,", b",7,0,")
        await write("us-east", "a", forged)
        assert fleet.stats.heartbeats_dropped["bad_signature"] == 1
        # Signed, but in another region's hash (read once a full read has found it), or
        # under another worker's name.
        await write("eu-west", "a", signer.signed_record(load_record(busy)))
        await write("us-east", "b", signer.signed_record(load_record(busy)))
        # A signature no signer writes (not hex; raw UTF-8): refused as malformed, and the
        # collector goes on (comparing it as a str would raise).
        await write("us-east", "a", load_record(busy)[:-1] + ',"k1","éz"]'.encode())
        assert collector.rejected_heartbeats == rejected + 3
        old = signer.signed_record(load_record(with_load(
            signer.sign(lasting("a", seq=0, sent_at_s=time.time() - 5)), 8)))
        await write("us-east", "a", old)  # signed, but older than what the router has
        assert {w: v.running for w, v in fleet.holder.current.workers.items()} == {
            "a": 0, "b": 0}
        # The worker's own next record is taken.
        await write("us-east", "a", signer.signed_record(load_record(busy)))
        await until(lambda: fleet.holder.current.workers["a"].running == 8)
    await admin.aclose()


async def test_a_refused_record_is_counted_once_though_its_worker_ages_out(
    valkey: EmbeddedValkey,
) -> None:
    """The table forgets what it read of a worker that leaves (so that its record is taken
    again if it comes back); a record refused for what it is stays refused, and counted
    once, however often the loads are read after (the heartbeat fuzz saw a worker's
    hostile record counted a second time when the worker expired)."""
    admin = connect(valkey.url)
    async with following(valkey.url) as fleet:
        collector = fleet.collector
        assert collector is not None
        await fleet.publish("a")
        await until(lambda: fleet.fresh() == {"a"})
        rejected = collector.rejected_heartbeats
        hostile = load_record(fleet.beat("a")).replace(b",0,0,", b",0,-1,", 1)  # waiting
        await admin.hset(KEYS.loads("us-east"), "a", hostile)
        await until(lambda: collector.rejected_heartbeats == rejected + 1)
        await until(lambda: "a" not in fleet.holder.current.workers, timeout_s=5.0)
        reads = collector.load_reads
        await fleet.publish("b")  # a region with a worker: its loads are read
        await until(lambda: collector.load_reads >= reads + 5)
        assert collector.rejected_heartbeats == rejected + 1
    await admin.aclose()


async def test_load_records_of_long_gone_workers_are_deleted(valkey: EmbeddedValkey) -> None:
    admin = connect(valkey.url)
    async with following(valkey.url) as fleet:
        await fleet.publish("a")
        await until(lambda: fleet.fresh() == {"a"})
        crashed = fleet.beat("crashed").model_copy(update={"sent_at_s": time.time() - 400})
        recent = fleet.beat("recent")  # its agent just stopped: its key expires, not this
        await admin.hset(KEYS.loads("us-east"), mapping={
            "crashed": load_record(crashed), "recent": load_record(recent)})
        for _ in range(100):  # up to 5 s: at its next read of the loads, in fact
            if not await admin.hexists(KEYS.loads("us-east"), "crashed"):
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the crashed worker's load record was not deleted")
        assert await admin.hexists(KEYS.loads("us-east"), "recent")
        assert await admin.hexists(KEYS.loads("us-east"), "a")
        assert fleet.fresh() == {"a"}
        # A record read before its worker was known (a router started beside a running
        # fleet reads them all so) is no longer an orphan once the worker is: not looked
        # at again at every read.
        collector = fleet.collector
        assert collector is not None and b"recent" in collector._loads.orphans
        await fleet.publish("recent")
        await until(lambda: "recent" in fleet.fresh())
        await until(lambda: b"recent" not in collector._loads.orphans, timeout_s=2.0)
    await admin.aclose()


async def test_a_large_fleets_records_are_taken_in_with_other_tasks_running_between(
    valkey: EmbeddedValkey,
) -> None:
    """1,600 changed load records read at once are taken in RECORDS_PER_TURN at a time,
    with the event loop running in between (taking all of 10,000 in one go held every
    request ~50 ms): a task running meanwhile sees part of them taken."""
    workers = [f"w{i:04d}" for i in range(1_600)]
    async with following(valkey.url) as fleet:
        collector = fleet.collector
        assert collector is not None
        beats = [fleet.beat(w).model_copy(update={"ttl_s": 30.0}) for w in workers]
        # In waves no wider than the publisher's connection pool: 1,600 at once wait for
        # its 16 connections, and on a busy host some waited past the pool's 1 s bound
        # (RedisUnavailableError: "No connection available"), as an agent never would.
        for first in range(0, len(beats), 16):
            await asyncio.gather(*(fleet.publisher.publish(beat)
                                   for beat in beats[first:first + 16]))
        await until(lambda: len(fleet.fresh()) == len(workers))
        taken_from = collector.applied_records
        seen: set[int] = set()

        async def watch() -> None:
            while True:
                seen.add(collector.applied_records - taken_from)
                await asyncio.sleep(0)

        watcher = asyncio.create_task(watch())
        admin = connect(valkey.url)
        newer = [with_load(beat, 3).model_copy(update={"seq": beat.seq + 10_000})
                 for beat in beats]
        # One HSET: every record changes between two reads of the collector.
        await admin.hset(KEYS.loads("us-east"), mapping={
            beat.worker_id: load_record(beat) for beat in newer})
        await until(lambda: collector.applied_records - taken_from == len(workers))
        watcher.cancel()
        await admin.aclose()
        assert {n for n in seen if 0 < n < len(workers)}, sorted(seen)
        await until(lambda: {view.running for view in fleet.holder.current.workers.values()}
                    == {3})  # in the next snapshot


async def test_records_read_less_often_than_a_ttl_keep_live_workers_and_age_out_silent_ones(
    valkey: EmbeddedValkey, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A large fleet's load records are read every second or so (as often as the share of
    a core the config allows for keeping the view), which can be longer than the workers'
    TTL: a worker whose records keep changing stays fresh from one read to the next, even
    while messages of other workers move the router's clock on in between (it is never
    dropped from the table, to be read back from its key); a silent one still goes
    stale."""
    monkeypatch.setattr(pace_module, "MIN_REBUILD_INTERVAL_S", 1.5)  # > TTL_S
    # The scans for expired workers fall between two reads, more than a TTL after the first.
    monkeypatch.setattr(collector_module, "EXPIRY_CHECK_S", 1.2)
    async with following(valkey.url) as fleet:
        collector = fleet.collector
        assert collector is not None

        async def change_state() -> None:  # a message on the channel every 0.2 s
            for n in range(100):
                await fleet.publish("m", state=(LifecycleState.READY,
                                                LifecycleState.DRAINING)[n % 2])
                await asyncio.sleep(0.2)

        quiet = asyncio.create_task(fleet.keep_publishing("quiet"))
        tasks = [quiet, asyncio.create_task(fleet.keep_publishing("a")),
                 asyncio.create_task(change_state())]
        try:
            await until(lambda: {"a", "quiet"} <= fleet.fresh())
            quiet.cancel()  # silent from now on
            started = time.monotonic()
            quiet_gone_s = None
            while time.monotonic() - started < 8.0:
                fresh = fleet.fresh()
                assert "a" in fresh and "a" in collector._table.views, time.monotonic() - started
                if quiet_gone_s is None and "quiet" not in fresh:
                    quiet_gone_s = time.monotonic() - started
                await asyncio.sleep(0.05)
            # Stale within the reads' margin (2 x 1.5 s + 0.1 s: longer than its TTL) of
            # the last read that took its record, and one more read.
            assert quiet_gone_s is not None and quiet_gone_s < 1.5 + 3.1 + 1.5 + 0.5
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def test_load_records_are_read_a_few_times_per_agent_interval_and_messages_at_once(
    valkey: EmbeddedValkey,
) -> None:
    """A small fleet is built every 20 ms, but its records, written once per agent
    interval, are read only LOAD_READS_PER_INTERVAL times in one; a state change, which
    comes as a message, still reaches the view at the next build."""
    for agent_interval_s, reads_per_s in ((0.0, 50.0), (5.0, 2.0)):
        async with following(valkey.url, agent_interval_s=agent_interval_s) as fleet:
            collector = fleet.collector
            assert collector is not None
            publishing = asyncio.create_task(fleet.keep_publishing("a"))
            try:
                await until(lambda: "a" in fleet.fresh())
                before, started = collector.load_reads, time.monotonic()
                await asyncio.sleep(3.0)
                rate = (collector.load_reads - before) / (time.monotonic() - started)
                if agent_interval_s:
                    assert 0.5 * reads_per_s <= rate <= 1.3 * reads_per_s, rate
                    assert collector.counts()["load_record_reads"] == collector.load_reads
                    publishing.cancel()
                    sent = time.monotonic()
                    await fleet.publish("a", state=LifecycleState.DRAINING)
                    await until(lambda: not fleet.holder.current.workers["a"].ready, 2.0)
                    assert time.monotonic() - sent < 0.3  # not a read interval (0.5 s) later
                else:
                    assert rate > 0.4 * reads_per_s, rate  # every build, as before
            finally:
                publishing.cancel()
                await asyncio.gather(publishing, return_exceptions=True)
