"""The tap channel (`<prefix>:heartbeats:all`) costs Redis nothing while nobody listens.

A real Valkey, the real publisher; what Redis executed is read from its own counters
(`INFO commandstats`), what a watcher hears from a real subscription.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from lab.devstack.valkey import EmbeddedValkey
from worker.heartbeat_keys import HeartbeatKeys
from worker.publisher import TAP_RECHECK_S, HeartbeatPublisher
from worker.redis_client import connect, connect_pubsub
from worker.schema import Capacity, Heartbeat, LifecycleState, Load

pytestmark = pytest.mark.integration

KEYS = HeartbeatKeys("gp-tap")


@pytest.fixture
async def valkey() -> AsyncIterator[EmbeddedValkey]:
    server = await asyncio.to_thread(EmbeddedValkey.start)
    yield server
    await asyncio.to_thread(server.stop)


def _beat(seq: int) -> Heartbeat:
    return Heartbeat(worker_id="w1", region="us-east", endpoint="http://10.0.0.1:8000",
                     models=("m",), state=LifecycleState.READY,
                     capacity=Capacity(max_num_seqs=8),
                     load=Load(running=seq % 3, waiting=0, kv_cache_usage=0.0), seq=seq,
                     sent_at_s=time.time(), ttl_s=30.0)


async def _publishes(url: str) -> int:
    """PUBLISH commands Valkey has executed so far."""
    redis = connect(url)
    try:
        stats = await redis.info("commandstats")
    finally:
        await redis.aclose()
    return int(stats.get("cmdstat_publish", {}).get("calls", 0))


async def test_nobody_listening_then_a_watcher_hears_every_heartbeat_within_the_recheck(
        valkey: EmbeddedValkey) -> None:
    now = [1000.0]
    publisher = HeartbeatPublisher(connect(valkey.url), KEYS, signer=None,
                                   clock=lambda: now[0])
    try:
        before = await _publishes(valkey.url)
        for seq in range(1, 6):  # 5 heartbeats, 0.5 s apart, nobody on the tap
            await publisher.publish(_beat(seq))
            now[0] += 0.5
        # The first heartbeat announces the worker on the routers' channel and tries the
        # tap once (nobody); the next 4 send neither: 2 PUBLISH in all, against 6.
        assert await _publishes(valkey.url) - before == 2

        watcher = connect_pubsub(valkey.url)
        subscription = watcher.pubsub()
        await subscription.subscribe(KEYS.tap)
        await subscription.get_message(timeout=1.0)  # the subscribe confirmation
        subscribed_at = now[0]
        heard: list[float] = []  # when each heartbeat the watcher heard was sent
        for seq in range(6, 30):  # 24 more, 0.5 s apart: past the recheck
            sent_at = now[0]
            await publisher.publish(_beat(seq))
            now[0] += 0.5
            message = await subscription.get_message(timeout=0.2)
            if message is not None and message["type"] == "message":
                assert b'"worker_id":"w1"' in message["data"]
                heard.append(sent_at)
        # TAP_RECHECK_S after the first try (t=1000), the tap is tried again, is heard,
        # and from then on every heartbeat goes out.
        assert heard[0] == 1000.0 + TAP_RECHECK_S and heard[0] - subscribed_at <= TAP_RECHECK_S
        assert heard == [heard[0] + 0.5 * n for n in range(len(heard))]
        first = len(heard)
        await subscription.aclose()  # type: ignore[no-untyped-call]
        await watcher.aclose()
        for seq in range(100, 104):  # the watcher left: one more try, then quiet again
            await publisher.publish(_beat(seq))
            now[0] += 0.5
        assert await _publishes(valkey.url) - before == 2 + first + 1
    finally:
        await publisher.aclose()
