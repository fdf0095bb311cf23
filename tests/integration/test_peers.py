"""Router replicas exchange their open requests through a real Valkey (router.registry.peers)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Callable, Mapping

import pytest

from lab.devstack.valkey import EmbeddedValkey
from router.core.stats import SecurityStats
from router.policy import RouteRequest, RoutingContext, create_policy
from router.registry.inflight import InFlight
from router.registry.peers import PEER_TTL_S, PeerExchange, encode_report
from router.registry.snapshot import Snapshot
from router.registry.worker_view import WorkerView
from worker.redis_client import connect, connect_pubsub
from worker.schema import Capacity, Heartbeat, LifecycleState, Load

pytestmark = pytest.mark.integration

KEYS = {"k1": b"0123456789abcdef0123"}
INTERVAL_S = 0.02


class Replica:
    """One router replica's exchange, running in the test's loop."""

    def __init__(self, url: str, channel: str, keys: Mapping[str, bytes] | None = None) -> None:
        self.inflight = InFlight()
        self.stats = SecurityStats()
        self.exchange = PeerExchange(redis=connect(url), pubsub_redis=connect_pubsub(url),
                                     channel=channel, inflight=self.inflight,
                                     interval_s=lambda: INTERVAL_S, keys=keys, stats=self.stats)
        self.task = asyncio.create_task(self.exchange.run())

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


@pytest.fixture
async def replicas(redis_url: str, key_prefix: str
                   ) -> AsyncIterator[Callable[..., Replica]]:
    started: list[Replica] = []

    def start(keys: Mapping[str, bytes] | None = None) -> Replica:
        replica = Replica(redis_url, f"{key_prefix}:routers:inflight", keys)
        started.append(replica)
        return replica

    yield start
    for replica in started:
        await replica.stop()


async def until(condition: Callable[[], bool], timeout_s: float = 3.0) -> float:
    """Seconds until `condition` held; fails the test after `timeout_s`."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"not within {timeout_s} s")
        await asyncio.sleep(0.005)
    return time.monotonic() - started


async def test_replicas_count_each_others_requests_until_one_leaves(
        replicas: Callable[..., Replica]) -> None:
    a, b = replicas(), replicas()
    await until(lambda: a.exchange.connected and b.exchange.connected)
    for _ in range(3):
        a.inflight.started("w1")
    b.inflight.started("w2")
    seen_after_s = await until(lambda: b.inflight.of("w1") == 3)
    await until(lambda: a.inflight.of("w2") == 1)
    assert seen_after_s < 0.5
    assert (b.inflight.own_of("w1"), b.inflight.of("w2")) == (0, 1)
    a.inflight.finished("w1")
    await until(lambda: b.inflight.of("w1") == 2)
    await a.stop()  # a clean stop says so: its requests stop counting at once
    gone_after_s = await until(lambda: b.inflight.peers() == {}, timeout_s=PEER_TTL_S / 2)
    assert b.inflight.of("w1") == 0
    print(f"peer counts seen after {1000 * seen_after_s:.0f} ms, "
          f"a departure after {1000 * gone_after_s:.0f} ms")


async def test_a_silent_peer_stops_counting_after_its_ttl(
        replicas: Callable[..., Replica], redis_url: str, key_prefix: str) -> None:
    b = replicas()
    await until(lambda: b.exchange.connected)
    redis = connect(redis_url)
    try:
        # A replica that died without a word: one report, then nothing.
        await redis.publish(f"{key_prefix}:routers:inflight",
                            encode_report("dead-replica", {"w1": 7}))
        await until(lambda: b.inflight.of("w1") == 7)
        silent_s = await until(lambda: b.inflight.of("w1") == 0, timeout_s=PEER_TTL_S + 2)
        assert silent_s > PEER_TTL_S / 2
    finally:
        await redis.aclose()


async def test_with_signing_keys_forged_reports_are_dropped(
        replicas: Callable[..., Replica], redis_url: str, key_prefix: str) -> None:
    a, b = replicas(KEYS), replicas(KEYS)
    await until(lambda: a.exchange.connected and b.exchange.connected)
    redis = connect(redis_url)
    try:
        channel = f"{key_prefix}:routers:inflight"
        await redis.publish(channel, encode_report("forger", {"w1": 50}))
        await redis.publish(channel, encode_report("forger", {"w1": 50},
                                                   ("k1", b"guessed-secret-0000")))
        await redis.publish(channel, b"garbage")
        a.inflight.started("w1")
        await until(lambda: b.exchange.rejected_reports >= 3 and b.inflight.of("w1") == 1)
        assert "forger" not in b.inflight.peers()
        assert b.stats.peer_reports_dropped == {"unsigned": 1, "bad_signature": 1,
                                                "malformed": 1}
    finally:
        await redis.aclose()


async def test_an_unreachable_redis_leaves_each_replica_with_its_own_counts() -> None:
    server = EmbeddedValkey.start()
    a = b = None
    try:
        a = Replica(server.url, "gptest-peers-down")
        b = Replica(server.url, "gptest-peers-down")
        a.inflight.started("w1")
        await until(lambda: b.inflight.of("w1") == 1)
        server.stop()
        await until(lambda: not b.exchange.connected)
        await until(lambda: b.inflight.of("w1") == 0, timeout_s=PEER_TTL_S + 2)
        assert not b.task.done()  # still trying to reconnect, never crashed
        assert a.inflight.of("w1") == 1  # its own requests still count
    finally:
        for replica in (a, b):
            if replica is not None:
                await replica.stop()
        with contextlib.suppress(Exception):
            server.stop()


def _view(worker_id: str, running: int) -> WorkerView:
    heartbeat = Heartbeat(
        worker_id=worker_id, region="us-east", endpoint=f"http://127.0.0.1:1/{worker_id}",
        models=("m",), state=LifecycleState.READY, capacity=Capacity(max_num_seqs=4),
        load=Load(running=running, waiting=0, kv_cache_usage=0.1), seq=1,
        sent_at_s=time.time(), ttl_s=60.0)
    return WorkerView(heartbeat, time.monotonic())


def _first_picks(inflight: InFlight, snapshot: Snapshot, count: int) -> list[str]:
    context = RoutingContext(rtt_ms=lambda _a, _b: 0.0, inflight=inflight,
                             rng=random.Random(1))
    policy = create_policy("predicted_ttft", context)
    picks = []
    for _ in range(count):
        worker = policy.pick(snapshot, RouteRequest(model="m", origin_region="us-east",
                                                    prompt_tokens=100)).worker.worker_id
        inflight.started(worker)
        picks.append(worker)
    return picks


async def test_two_replicas_do_not_herd_onto_the_momentarily_best_worker(
        replicas: Callable[..., Replica]) -> None:
    # `idle` reported nothing running, `busy` all 4 of its slots: every replica sees
    # `idle` as best until its next heartbeat.
    snapshot = Snapshot.build([_view("idle", 0), _view("busy", 4)], built_at_s=time.monotonic(),
                              redis_connected=True, last_redis_ok_at_s=time.monotonic())
    a, b = replicas(), replicas()
    await until(lambda: a.exchange.connected and b.exchange.connected)
    assert _first_picks(a.inflight, snapshot, 4) == ["idle"] * 4  # now `idle` is full too
    a.inflight.started("idle")  # and one waits there
    # Without the exchange a second replica would still send to `idle` (herding)...
    assert _first_picks(InFlight(), snapshot, 1) == ["idle"]
    # ...with it, replica b counts a's five and sends its request to `busy`.
    await until(lambda: b.inflight.of("idle") == 5)
    assert _first_picks(b.inflight, snapshot, 1) == ["busy"]
