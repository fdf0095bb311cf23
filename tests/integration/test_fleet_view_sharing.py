"""One fleet view per machine (router.registry.feed and mirror): with `--processes N` the
first process reads Redis and ships its view; the others mirror it, read no heartbeat
themselves, and follow Redis on their own while the first process is killed or stuck."""

from __future__ import annotations

import asyncio
import marshal
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest

from lab.devstack.valkey import free_port
from router.registry import HeartbeatCollector, SnapshotHolder
from router.registry.feed import HEADER, ViewFeed
from router.registry.mirror import MirroredCollector
from tests.conftest import skip_unless_slow_tests_are_asked_for
from tests.integration.conftest import StartSim
from tests.integration.test_router_processes import (
    Machine,
    chat,
    machine_config,
    sample,
    spawn_machine,
    until,
)
from worker.heartbeat_keys import HeartbeatKeys
from worker.publisher import HeartbeatPublisher
from worker.redis_client import connect, connect_pubsub
from worker.schema import Capacity, Heartbeat, LifecycleState, Load, Performance

pytestmark = pytest.mark.integration
# The tests that kill or stop process 0 (~5 s each: the default run stays under 15 min).
SLOW = "process 0 killed or stopped"


def heartbeat(worker_id: str, url: str, *, running: int = 0, seq: int = 1,
              state: LifecycleState = LifecycleState.READY, ttl_s: float = 600.0) -> Heartbeat:
    return Heartbeat(
        worker_id=worker_id, region="us-east", endpoint=url, models=("m",), state=state,
        capacity=Capacity(max_num_seqs=64),
        load=Load(running=running, waiting=0, kv_cache_usage=0.1),
        performance=Performance(ttft_ms=30.0, itl_ms=8.0, e2e_ms=400.0),
        seq=seq, sent_at_s=time.time(), ttl_s=ttl_s)


class Fleet:
    """A supervisor of router processes and the publisher of its workers' heartbeats."""

    def __init__(self, machine: Machine, publisher: HeartbeatPublisher,
                 urls: dict[str, str]) -> None:
        self.machine = machine
        self.publisher = publisher
        self.urls = urls

    def own(self, index: int, name: str, **labels: str) -> float:
        return sample(self.machine.own_metrics(index), name, **labels)

    async def until_workers(self, index: int, count: int, timeout_s: float) -> None:
        async def seen() -> bool:
            try:
                return self.own(index, "globalpool_fleet_view_workers") == count
            except OSError:  # (re)starting
                return False

        await until(seen, timeout_s, f"process {index} never saw {count} workers")


@pytest.fixture
async def fleet(redis_url: str, tmp_path: Path, start_sim: StartSim
                ) -> AsyncIterator[Callable[[], Awaitable[Fleet]]]:
    publisher = HeartbeatPublisher(connect(redis_url), HeartbeatKeys(
        prefix := f"gptest-{uuid.uuid4().hex[:10]}"))
    started: list[Machine] = []

    async def start() -> Fleet:
        urls = {}
        for index, worker_id in enumerate(("a", "b", "c")):
            sim = await start_sim(served_model_names=("m",), seed=index)
            urls[worker_id] = sim.url
        for worker_id in ("a", "b"):
            await publisher.publish(heartbeat(worker_id, urls[worker_id]))
        port = free_port()
        config = machine_config(tmp_path / "regions.yaml", redis_url, prefix, port)
        machine = await spawn_machine(config, port, tmp_path / "router.log", 2)
        started.append(machine)
        return Fleet(machine, publisher, urls)

    yield start
    for machine in started:
        if machine.supervisor.poll() is None:
            for pid in machine.children().values():  # a test may have stopped one
                os.kill(pid, signal.SIGCONT)
            machine.supervisor.terminate()
            await asyncio.to_thread(machine.supervisor.wait, 90)
    await publisher.aclose()


async def test_the_second_process_mirrors_the_first_and_reads_no_heartbeat(
        fleet: Callable[[], Awaitable[Fleet]], http: aiohttp.ClientSession) -> None:
    f = await fleet()
    await f.until_workers(1, 2, 10)
    # A new worker, a load change and a degraded worker reach the mirror as they reach
    # the first process.
    await f.publisher.publish(heartbeat("c", f.urls["c"]))
    await f.until_workers(1, 3, 5)
    await f.publisher.publish(heartbeat("b", f.urls["b"], seq=2,
                                        state=LifecycleState.DEGRADED))

    async def b_degraded() -> bool:
        text = f.machine.own_metrics(1)
        return sample(text, "globalpool_fleet_view_workers", state="degraded") == 1

    await until(b_degraded, 5, "the mirror never saw b degraded")
    statuses = await asyncio.gather(*(chat(http, f.machine.url) for _ in range(40)))
    assert statuses == [200] * 40
    served = [f.own(index, "globalpool_requests_total") for index in (0, 1)]
    assert min(served) > 0, served  # both processes routed
    # The first process read the fleet; the second took its frames and parsed nothing.
    assert f.own(0, "globalpool_heartbeats_parsed_total") >= 3
    assert f.own(0, "globalpool_load_record_reads_total") > 0
    assert f.own(1, "globalpool_fleet_view_frames_mirrored_total") > 0
    assert f.own(1, "globalpool_heartbeats_parsed_total") == 0
    assert f.own(1, "globalpool_load_record_reads_total") == 0
    assert f.own(1, "globalpool_heartbeat_messages_total") == 0


@pytest.mark.slow
async def test_a_killed_first_process_leaves_the_second_following_redis_itself(
        fleet: Callable[[], Awaitable[Fleet]], http: aiohttp.ClientSession,
        request: pytest.FixtureRequest) -> None:
    skip_unless_slow_tests_are_asked_for(request.config, SLOW)
    f = await fleet()
    await f.until_workers(1, 2, 10)
    first = f.machine.children()[0]
    os.kill(first, signal.SIGKILL)
    # While the first process is gone (until the supervisor has started it again and it
    # has read Redis), the second routes and takes in a new worker by itself.
    await f.publisher.publish(heartbeat("c", f.urls["c"]))
    await f.until_workers(1, 3, 10)
    statuses = await asyncio.gather(*(chat(http, f.machine.url) for _ in range(20)))
    assert statuses == [200] * 20
    log = f.machine.log.read_text()
    assert "following Redis in this process" in log

    async def mirroring_again() -> bool:
        text = await asyncio.to_thread(f.machine.log.read_text)
        return text.count("mirroring the first router process's") >= 2

    await until(mirroring_again, 20, "the second process never mirrored the restarted first")
    assert f.machine.children()[0] != first
    parsed = f.own(1, "globalpool_heartbeats_parsed_total")
    assert parsed > 0  # it read Redis meanwhile
    await f.publisher.publish(heartbeat("a", f.urls["a"], seq=5, running=3))
    await asyncio.sleep(1.5)
    assert f.own(1, "globalpool_heartbeats_parsed_total") == parsed  # mirroring again
    assert f.own(1, "globalpool_fleet_view_own_reads_total") == 1


@pytest.mark.slow
async def test_a_stuck_first_process_is_noticed_by_its_silence(
        fleet: Callable[[], Awaitable[Fleet]], request: pytest.FixtureRequest) -> None:
    skip_unless_slow_tests_are_asked_for(request.config, SLOW)
    f = await fleet()
    await f.until_workers(1, 2, 10)
    first = f.machine.children()[0]
    os.kill(first, signal.SIGSTOP)  # a stuck process: its socket accepts, it sends nothing
    try:
        await f.publisher.publish(heartbeat("c", f.urls["c"]))
        started = time.monotonic()
        await f.until_workers(1, 3, 10)
        # Silence for FEED_SILENT_S (3 s), then its own full read.
        assert time.monotonic() - started < 8
    finally:
        os.kill(first, signal.SIGCONT)

    async def mirroring_again() -> bool:
        text = await asyncio.to_thread(f.machine.log.read_text)
        return text.count("mirroring the first router process's") >= 2

    await until(mirroring_again, 15, "the second process never mirrored the first again")
    assert f.machine.children()[0] == first


class Pair:
    """In one process: a collector that ships its view, and one that mirrors it."""

    def __init__(self, redis_url: str, path: Path) -> None:
        self.keys = HeartbeatKeys(f"gptest-{uuid.uuid4().hex[:10]}")
        self.publisher = HeartbeatPublisher(connect(redis_url), self.keys)
        self.clients = [connect(redis_url), connect_pubsub(redis_url)] * 2
        self.first_holder, self.second_holder = SnapshotHolder(), SnapshotHolder()
        self.first = HeartbeatCollector(redis=self.clients[0], pubsub_redis=self.clients[1],
                                        keys=self.keys, holder=self.first_holder)
        self.feed = ViewFeed(self.first.table, path, self.first.synced, self.first.pace)
        self.first.publisher.on_published = self.feed.published
        self.second = MirroredCollector(HeartbeatCollector(
            redis=self.clients[2], pubsub_redis=self.clients[3], keys=self.keys,
            holder=self.second_holder), path)
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(each) for each in (
            self.first.run(), self.feed.serve(), self.second.run())]

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for client in self.clients:
            await client.aclose()
        await self.publisher.aclose()


@pytest.fixture
async def pair(redis_url: str, tmp_path: Path) -> AsyncIterator[Pair]:
    found = Pair(redis_url, tmp_path / "view.sock")
    yield found
    await found.aclose()


async def test_a_mirrored_view_is_the_view_it_mirrors(pair: Pair) -> None:
    """Every view the mirror makes carries the first's heartbeat, load, receipt and
    freshness, and so the same scoring terms; workers that leave, leave."""
    publisher, first_holder, second_holder = (pair.publisher, pair.first_holder,
                                              pair.second_holder)
    for index in range(300):
        await publisher.publish(heartbeat(f"w{index}", f"http://127.0.0.1:{9000 + index}",
                                          running=index % 7))
    pair.start()

    async def same() -> bool:
        ours, theirs = first_holder.current.workers, second_holder.current.workers
        return (len(ours) >= 299 and ours.keys() == theirs.keys()
                and all(ours[w].load_items() == theirs[w].load_items() for w in ours))

    await until(same, 10, "the mirror never matched")
    for index in range(0, 300, 3):  # new load for a third, a departure for another
        await publisher.publish(heartbeat(f"w{index}", f"http://127.0.0.1:{9000 + index}",
                                          running=index % 5 + 10, seq=2))
    await publisher.remove("w1")

    async def changed() -> bool:
        ours = first_holder.current.workers
        return "w1" not in ours and all(ours[f"w{i}"].seq == 2 for i in range(0, 300, 3))

    await until(changed, 10, "the first collector never took the changes")
    await until(same, 10, "the mirror never followed the changes")
    ours = first_holder.current.workers
    for view in second_holder.current.workers.values():
        mine = ours[view.worker_id]
        assert view.heartbeat == mine.heartbeat
        assert (view.queue_base, view.engine_ms, view.prefill_ms_per_token,
                view.utilisation, view.expires_at_s) == (
            mine.queue_base, mine.engine_ms, mine.prefill_ms_per_token,
            mine.utilisation, mine.expires_at_s)
    assert "w1" not in second_holder.current.workers
    assert pair.second.counts()["heartbeats_parsed"] == 0
    assert pair.second.mirroring and pair.second.frames > 0


async def test_an_idle_worker_stays_fresh_in_the_mirror_and_a_silent_one_goes(
        pair: Pair) -> None:
    """An idle worker's reports change nothing but their order: the mirror takes them in
    place (WorkerView.refresh) without building a snapshot, and the scoring rows routing
    reads must still see each one's freshness; a worker that stops reporting goes."""
    publisher = pair.publisher
    for worker_id in ("idle", "silent"):
        await publisher.publish(heartbeat(worker_id, "http://127.0.0.1:9999", ttl_s=1.0))
    pair.start()
    await until(lambda: _has(pair.second_holder, "idle", "silent"), 10, "never mirrored")
    builds = pair.second.upkeep()["builds"]
    for seq in range(2, 14):  # 3 s of reports with the same load, 4 a second
        await publisher.publish(heartbeat("idle", "http://127.0.0.1:9999", seq=seq,
                                          ttl_s=1.0))
        await asyncio.sleep(0.25)
    snapshot = pair.second_holder.current
    now = snapshot.freshness_now(time.monotonic())
    rows = {row[1]: row for row in snapshot.ready_terms("m")}
    assert rows["idle"][3] > now  # its expires_at_s, as the policy reads it
    assert pair.first_holder.current.workers["idle"].seq == 13
    assert snapshot.workers["idle"].seq == 13
    assert "silent" not in snapshot.workers  # its TTL ran out: dropped by the first
    # Taken in place: the silent worker's departure was the one change to build for.
    assert pair.second.upkeep()["builds"] - builds <= 3


async def _has(holder: SnapshotHolder, *worker_ids: str) -> bool:
    return all(worker_id in holder.current.workers for worker_id in worker_ids)


@pytest.mark.parametrize("garbage", [
    HEADER.pack(5) + b"\x00junk",  # not marshal data
    HEADER.pack(2**31) + b"x" * 64,  # announces a frame of 2 GB
    HEADER.pack(3) + marshal.dumps(7)[:3],  # marshal data, not a frame
], ids=["not-marshal", "oversize", "not-a-frame"])
async def test_a_feed_that_sends_garbage_is_left_for_redis(
        redis_url: str, tmp_path: Path, garbage: bytes) -> None:
    """Whatever the socket carries, the mirror does not crash or take it: it follows
    Redis itself, and its view is the fleet's."""
    path = tmp_path / "view.sock"

    async def answer(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(garbage)
        await writer.drain()
        await asyncio.sleep(30)

    server = await asyncio.start_unix_server(answer, path=str(path))
    keys = HeartbeatKeys(f"gptest-{uuid.uuid4().hex[:10]}")
    publisher = HeartbeatPublisher(connect(redis_url), keys)
    await publisher.publish(heartbeat("w", "http://127.0.0.1:9999"))
    clients = [connect(redis_url), connect_pubsub(redis_url)]
    holder = SnapshotHolder()
    mirror = MirroredCollector(HeartbeatCollector(
        redis=clients[0], pubsub_redis=clients[1], keys=keys, holder=holder), path)
    task = asyncio.create_task(mirror.run())
    try:
        await until(lambda: _has(holder, "w"), 10, "the mirror never read Redis itself")
        assert not task.done()
        assert not mirror.mirroring and mirror.own_reads == 1
        assert mirror.counts()["heartbeats_parsed"] >= 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        server.close()
        for client in clients:
            await client.aclose()
        await publisher.aclose()


async def test_shipping_is_paced_only_while_a_sibling_takes_it(pair: Pair) -> None:
    """Process 0 counts what shipping costs in its pace while a sibling mirrors it, and
    stops counting it once none does (its builds would be spaced for nothing)."""
    for index in range(200):
        await pair.publisher.publish(heartbeat(f"w{index}", "http://127.0.0.1:9999"))
    pair.start()
    await until(lambda: _has(pair.second_holder, "w0", "w199"), 10, "never mirrored")
    for seq in range(2, 6):  # changes to ship
        for index in range(200):
            await pair.publisher.publish(heartbeat(f"w{index}", "http://127.0.0.1:9999",
                                                   seq=seq, running=seq))
        await asyncio.sleep(0.1)
    assert pair.first.pace.shipped_s > 0
    mirror = pair._tasks.pop()  # the sibling goes away
    mirror.cancel()
    await asyncio.gather(mirror, return_exceptions=True)

    async def not_paced() -> bool:
        await pair.publisher.publish(heartbeat("w0", "http://127.0.0.1:9999",
                                               seq=int(time.time() * 1000)))
        return pair.first.pace.shipped_s == 0.0

    await until(not_paced, 10, "shipping still paced with no sibling")
