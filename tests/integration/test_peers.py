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
from router.registry.peer_reports import encode_report
from router.registry.peers import PEER_TTL_S, PeerExchange
from router.registry.snapshot import Snapshot
from router.registry.worker_view import WorkerView
from worker.redis_client import connect, connect_pubsub
from worker.schema import Capacity, Heartbeat, LifecycleState, Load, Performance

pytestmark = pytest.mark.integration

KEYS = {"k1": b"0123456789abcdef0123"}
INTERVAL_S = 0.02


class Replica:
    """One router replica's exchange, running in the test's loop."""

    def __init__(self, url: str, channel: str, keys: Mapping[str, bytes] | None = None,
                 region: str | None = None) -> None:
        self.inflight = InFlight()
        self.stats = SecurityStats()
        self.exchange = PeerExchange(redis=connect(url), pubsub_redis=connect_pubsub(url),
                                     channel=channel, inflight=self.inflight,
                                     interval_s=lambda: INTERVAL_S, keys=keys, stats=self.stats,
                                     region=region)
        self.task = asyncio.create_task(self.exchange.run())

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


@pytest.fixture
async def replicas(redis_url: str, key_prefix: str
                   ) -> AsyncIterator[Callable[..., Replica]]:
    started: list[Replica] = []

    def start(keys: Mapping[str, bytes] | None = None, region: str | None = None) -> Replica:
        replica = Replica(redis_url, f"{key_prefix}:routers:inflight", keys, region)
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


def _view(worker_id: str, running: int, region: str = "us-east", slots: int = 4
          ) -> WorkerView:
    heartbeat = Heartbeat(
        worker_id=worker_id, region=region, endpoint=f"http://127.0.0.1:1/{worker_id}",
        models=("m",), state=LifecycleState.READY, capacity=Capacity(max_num_seqs=slots),
        load=Load(running=running, waiting=0, kv_cache_usage=0.1), seq=1,
        sent_at_s=time.time(), ttl_s=60.0,
        performance=Performance(e2e_ms=2000.0, itl_ms=20.0, prefill_tokens_per_s=8000.0))
    return WorkerView(heartbeat, time.monotonic())


def _rtt(origin: str, region: str) -> float:
    return 1.0 if origin == region else 80.0


def _first_picks(inflight: InFlight, snapshot: Snapshot, count: int,
                 rtt: Callable[[str, str], float] = lambda _a, _b: 0.0) -> list[str]:
    context = RoutingContext(rtt_ms=rtt, inflight=inflight, rng=random.Random(1))
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


async def test_a_synchronized_burst_to_two_replicas_of_a_region_does_not_herd(
        replicas: Callable[..., Replica]) -> None:
    """20 requests reach each of two replicas of us-east at the same instant, before
    either can report them: each counts its own requests once more for its sibling, so
    that together they fill us-east's 8 free slots and send the rest 80 ms away to
    eu-west's 32, as one replica sending all 40 does; without that they would put twice
    as many into us-east's queues."""
    fleet = [_view("us-1", 0), _view("us-2", 0),
             *(_view(f"eu-{i}", 0, region="eu-west", slots=8) for i in range(4))]
    snapshot = Snapshot.build(fleet, built_at_s=time.monotonic(), redis_connected=True,
                              last_redis_ok_at_s=time.monotonic())

    def local(picks: list[str]) -> int:
        return sum(1 for worker in picks if worker.startswith("us-"))

    alone = local(_first_picks(InFlight(), snapshot, 40, _rtt))
    blind = local(_first_picks(InFlight(), snapshot, 20, _rtt)) * 2  # no exchange
    a, b = replicas(region="us-east"), replicas(region="us-east")
    await until(lambda: a.inflight.echo == 1 and b.inflight.echo == 1)  # idle: keepalives
    # Both bursts are routed within one turn of the loop: no report comes in between.
    together = local(_first_picks(a.inflight, snapshot, 20, _rtt)) + local(
        _first_picks(b.inflight, snapshot, 20, _rtt))
    queued = {"alone": alone - 8, "blind": blind - 8, "together": together - 8}
    print("queued in us-east beyond its free slots:", queued)
    assert queued["blind"] > 2 * max(1, queued["alone"]), queued  # the herd, without echo
    assert queued["together"] <= 2 * max(1, queued["alone"]), queued
    # Once the echoes have lived their two report intervals, only real counts remain.
    await until(lambda: a.inflight.echoes() == 0 and b.inflight.echoes() == 0)
    assert a.inflight.of("us-1") + a.inflight.of("us-2") == together
