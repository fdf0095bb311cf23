"""Redis/Valkey Cluster, on real server processes: three primaries with a replica each
(`lab.devstack.cluster`), a real router process, real agents and simulators in two
regions, pointed at its `redis+cluster://` URL.

Each region's heartbeat plane is one hash slot (`{region}`), on the node of that slot,
with its own sharded channel; drain flags, files and batches share the `{prefix}` slot.
The primary of one region's slot is SIGKILLed while requests flow: the router fails
static through the gap, the cluster promotes that primary's replica, and the agents and
the router find the new node from the slot map. A drain and a batch then go through.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import secrets
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis
from openai import AsyncOpenAI
from redis.exceptions import RedisError

from lab.devstack.cluster import ValkeyCluster, key_slot
from lab.devstack.stack import LocalStack
from lab.devstack.valkey import free_port
from lab.drill.redis_scenarios import every_heartbeat_sent_after
from router.admission.gcra import Bucket
from router.admission.redis_limiter import RateLimitKeys, RedisLimiter
from router.config_loader import load_config
from router.registry import HeartbeatCollector, SnapshotHolder
from router.registry.subscriber import Subscription
from tests.conftest import skip_for_missing_tool
from tests.integration.redis_failover import (
    FRESH_S,
    Streams,
    ages,
    certificate,
    drain_reaches_the_router,
    status_of,
)
from tests.integration.stack import small_config
from worker.heartbeat_keys import HeartbeatKeys
from worker.publisher import HeartbeatPublisher, RedisUnavailableError
from worker.redis_client import connect, connect_pubsub
from worker.schema import Capacity, Heartbeat, LifecycleState, Load

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

PREFIX = "gp-cluster"
REGIONS = ("us-east", "eu-west")


@pytest.fixture(params=["valkey", pytest.param("redis-tls", marks=pytest.mark.slow(
    why="the same drill on Debian's redis-server over TLS (~30 s); on Valkey in the default run"))])
def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ValkeyCluster]:
    binary, tls = None, None
    if request.param == "redis-tls":
        binary = shutil.which("redis-server")
        if binary is None:
            skip_for_missing_tool("redis-server (Debian: apt-get install redis-server) runs "
                                  "the TLS cluster")
        tls = certificate(tmp_path)
    group = ValkeyCluster.start(tmp_path / "cluster", primaries=3, replicas_per_primary=1,
                                password=secrets.token_urlsafe(12), binary=binary, tls=tls)
    try:
        yield group
    finally:
        group.stop()


def _tls(cluster: ValkeyCluster) -> dict[str, Any]:
    """redis-py's arguments for the test's own look at the cluster's nodes."""
    return {} if cluster.tls is None else {"ssl": True,
                                           "ssl_ca_certs": str(cluster.tls.cert)}


def _keys_by_node(cluster: ValkeyCluster) -> dict[int, list[bytes]]:
    """Every key, by the port of the primary that holds it (asked of each node)."""
    found: dict[int, list[bytes]] = {}
    for node in cluster.primaries:
        if node in cluster.killed:
            continue
        client = redis.Redis(host=node.host, port=node.port, password=cluster.password,
                             **_tls(cluster))
        try:
            found[node.port] = sorted(client.scan_iter(match=f"*{PREFIX}*", count=1000))
        finally:
            client.close()
    return found


async def _until_fresh(session: aiohttp.ClientSession, stack: LocalStack, workers: int,
                       timeout_s: float) -> dict[str, Any] | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, AssertionError):
            status = await status_of(session, stack)
            if (status["redis"]["connected"] and len(status["workers"]) == workers
                    and max(ages(status)) < FRESH_S):
                return status
        await asyncio.sleep(0.1)
    return None


async def test_a_cluster_carries_the_fleet_and_survives_losing_a_regions_primary(
        tmp_path: Path, cluster: ValkeyCluster) -> None:
    slots = {region: key_slot(f"{{{region}}}".encode()) for region in REGIONS}
    homes = {region: cluster.node_for_slot(slot) for region, slot in slots.items()}
    assert homes["us-east"] is not homes["eu-west"], "the regions' slots share a node"
    simulated = {"workers": 2, "max_num_seqs": 8, "decode_step_ms": 5}
    config_path = small_config(
        tmp_path, redis={"url": cluster.url, "key_prefix": PREFIX},
        batch={"storage": f"file://{tmp_path}/files", "lease_s": 2},
        regions={"us-east": {"rtt_ms": {"eu-west": 20}, "models": ["tiny-llama"],
                             "simulated": simulated},
                 "eu-west": {"models": ["tiny-llama"], "simulated": simulated}})
    stack = LocalStack(load_config(config_path), config_path, host="127.0.0.1",
                       port=free_port(), log_dir=tmp_path / "logs", redis_url=cluster.url,
                       admin_token=secrets.token_urlsafe(16))
    await stack.start()
    try:
        async with aiohttp.ClientSession() as session:
            status = await _until_fresh(session, stack, 4, 30.0)
            assert status is not None, "the router never saw the four workers"
            # Each region's heartbeat plane lives on its slot's node, and nowhere else.
            by_node = _keys_by_node(cluster)
            for region, home in homes.items():
                plane = {key for key in by_node[home.port] if f"{{{region}}}".encode() in key}
                assert len([k for k in plane if b":hb:" in k]) == 2, (region, plane)
                assert f"{PREFIX}:loads:{{{region}}}".encode() in plane

            streams = Streams(session, stack.router_url)
            await asyncio.sleep(1.0)
            before = streams.sent
            old = homes["us-east"]
            cluster.kill(old)
            killed_at = time.monotonic()
            promoted = await asyncio.to_thread(cluster.wait_for_failover, old, 30.0)
            promoted_s = time.monotonic() - killed_at
            fresh = await _until_fresh(session, stack, 4, 40.0)
            # The router keeps a worker it cannot hear from fresh while Redis is out of
            # reach (fail static): the agents' own new heartbeats, in Redis, say when
            # they reached the promoted node.
            live = next(node for node in cluster.primaries if node not in cluster.killed)
            published_s = await asyncio.to_thread(
                every_heartbeat_sent_after,
                lambda: redis.RedisCluster(host=live.host, port=live.port,
                                           password=cluster.password, **_tls(cluster)),
                PREFIX, 4, time.time() - (time.monotonic() - killed_at), timeout_s=30.0)
            fresh_s = time.monotonic() - killed_at if fresh is not None else None
            await asyncio.sleep(1.0)  # requests keep flowing after the failover
            await streams.stop()
            sent, failures = streams.sent, streams.failures
            report = {"requests": sent, "during_and_after": sent - before,
                      "failed": len(failures), "promoted_after_s": round(promoted_s, 2),
                      "new_primary": promoted.port,
                      "router_fresh_after_s": None if fresh_s is None else round(fresh_s, 2),
                      "every_agent_published_after_s": published_s}
            print(json.dumps(report | {"url": cluster.url.partition("://")[0]}))
            assert sent - before > 20, report  # the kill happened under load
            assert failures == [], (report, failures[:5])
            assert fresh_s is not None and fresh_s - promoted_s < 10.0, report
            assert published_s is not None and published_s - promoted_s < 10.0, report

            await _drain_and_batch(session, stack)
    finally:
        await stack.stop(timeout_s=5.0)


async def _drain_and_batch(session: aiohttp.ClientSession, stack: LocalStack) -> None:
    """A drain (a transaction on the `{prefix}` slot) reaches the router, and a batch
    (files, leases, scripts on that slot) runs to the end."""
    status = await status_of(session, stack)
    await drain_reaches_the_router(session, stack, status["workers"][0]["id"])

    openai = AsyncOpenAI(base_url=f"{stack.router_url}/v1", api_key="unused", max_retries=0)
    lines = b"".join(json.dumps({
        "custom_id": f"line-{number}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "tiny-llama", "max_tokens": 4,
                 "messages": [{"role": "user", "content": f"batch {number}"}]},
    }).encode() + b"\n" for number in range(6))
    uploaded = await openai.files.create(file=("input.jsonl", io.BytesIO(lines)),
                                         purpose="batch")
    created = await openai.batches.create(input_file_id=uploaded.id,
                                          endpoint="/v1/chat/completions",
                                          completion_window="24h")
    deadline = time.monotonic() + 60
    while (batch := await openai.batches.retrieve(created.id)).status not in (
            "completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, batch
        await asyncio.sleep(0.2)
    assert batch.status == "completed", batch
    assert batch.output_file_id is not None
    content = await openai.files.content(batch.output_file_id)
    answered = sorted(json.loads(line)["custom_id"] for line in content.text.splitlines())
    assert answered == sorted(f"line-{number}" for number in range(6))
    await openai.close()


def _beat(worker_id: str, region: str, seq: int) -> Heartbeat:
    return Heartbeat(worker_id=worker_id, region=region,
                     endpoint=f"http://127.0.0.1:1/{worker_id}", models=("m",),
                     state=LifecycleState.READY, capacity=Capacity(max_num_seqs=8),
                     load=Load(running=0, waiting=0, kv_cache_usage=0.0),
                     seq=seq, sent_at_s=time.time(), ttl_s=30.0)


async def _until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.02)


async def test_a_collector_follows_each_regions_sharded_channel_and_regions_added_later(
        tmp_path: Path) -> None:
    """Messages arrive on each followed region's own channel, from two nodes at once; a
    region added (a reload) is subscribed to without waiting for a full read."""
    group = ValkeyCluster.start(tmp_path / "cluster", primaries=3)
    keys = HeartbeatKeys("gp-shard", sharded=True)
    regions = {"us-east"}
    holder = SnapshotHolder()
    collector = HeartbeatCollector(
        redis=connect(group.url), pubsub_redis=connect_pubsub(group.url), keys=keys,
        holder=holder, full_read_interval_s=60.0, regions=lambda: set(regions))
    publisher = HeartbeatPublisher(connect(group.url), keys, signer=None)
    task = asyncio.create_task(collector.run())
    try:
        assert group.node_for_slot(key_slot(b"{us-east}")) is not group.node_for_slot(
            key_slot(b"{eu-west}"))
        async with asyncio.timeout(5.0):
            await collector.synced.wait()
        await publisher.publish(_beat("a", "us-east", 1))
        await _until(lambda: "a" in holder.current.workers)
        assert collector.received_heartbeats == 1  # on us-east's channel
        await publisher.publish(_beat("b", "eu-west", 1))
        await asyncio.sleep(0.5)
        assert "b" not in holder.current.workers  # not followed, not read in full yet
        assert collector.received_heartbeats == 1
        regions.add("eu-west")  # a reload adds the region: its channel is followed
        await _until(lambda: "b" in holder.current.workers)  # the new subscription's read
        await publisher.publish(_beat("c", "eu-west", 1))
        await _until(lambda: "c" in holder.current.workers, timeout_s=1.0)
        await publisher.publish(_beat("d", "us-east", 1))
        await _until(lambda: "d" in holder.current.workers, timeout_s=1.0)
        assert collector.received_heartbeats == 3  # a, then c and d on two nodes' channels
        await publisher.remove("c")  # `gone:c` on eu-west's channel
        await _until(lambda: "c" not in holder.current.workers, timeout_s=1.0)
        assert set(holder.current.workers) == {"a", "b", "d"}
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await publisher.aclose()
        group.stop()


async def test_rate_limits_are_shared_through_a_cluster_per_tenant_slot(tmp_path: Path) -> None:
    """The GCRA script charges a tenant's buckets together on its slot's node: two
    clients (two replicas) share one budget, and tenants on different nodes each have
    their own."""
    group = ValkeyCluster.start(tmp_path / "cluster", primaries=3)
    tenants = ("acme", "hooli")
    assert group.node_for_slot(key_slot(b"{acme}")) is not group.node_for_slot(
        key_slot(b"{hooli}"))
    limiters = [RedisLimiter(connect(group.url), RateLimitKeys("gp-rl")) for _ in range(2)]
    try:
        for limiter in limiters:
            await limiter.warm_up()
        for tenant in tenants:
            buckets = [Bucket("tenant:requests", "tenant", "requests", 5, 5, 1),
                       Bucket("key:k1:tokens", "key", "tokens", 1000, 1000, 100)]
            allowed = [(await limiters[n % 2].check(tenant, buckets)).allowed
                       for n in range(8)]
            assert allowed == [True] * 5 + [False] * 3, (tenant, allowed)
    finally:
        for limiter in limiters:
            await limiter.aclose()
        group.stop()


async def test_a_cluster_out_of_reach_fails_static_as_a_single_server_does(
        tmp_path: Path) -> None:
    """redis-py raises `RedisClusterException`, not a `RedisError`, when no node answers or
    a slot has no node; every caller's `except RedisError` then missed it (the agent's
    publish raised it, the collector crashed instead of failing static)."""
    url = f"redis+cluster://127.0.0.1:{free_port()}/"  # nothing listens there
    publisher = HeartbeatPublisher(connect(url), HeartbeatKeys("gp", sharded=True), signer=None)
    with pytest.raises(RedisUnavailableError):
        await publisher.publish(_beat("a", "us-east", 1))
    await publisher.aclose()
    with pytest.raises(RedisError):
        async with Subscription(connect_pubsub(url), ["gp:heartbeats:{us-east}"]):
            pass
    holder = SnapshotHolder()
    collector = HeartbeatCollector(redis=connect(url), pubsub_redis=connect_pubsub(url),
                                   keys=HeartbeatKeys("gp", sharded=True), holder=holder,
                                   regions=lambda: ["us-east"])
    task = asyncio.create_task(collector.run())
    await asyncio.sleep(1.0)
    assert not task.done(), task  # retrying with backoff, not crashed
    assert holder.current.redis_connected is False
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)

    # A slot without a node (its primary killed, no replica): that region's heartbeats
    # fail as Redis errors; another region's, on a live node, go on.
    group = ValkeyCluster.start(tmp_path / "cluster", primaries=3)
    publisher = HeartbeatPublisher(connect(group.url), HeartbeatKeys("gp", sharded=True),
                                   signer=None)
    try:
        await publisher.publish(_beat("a", "us-east", 1))
        group.kill(group.node_for_slot(key_slot(b"{us-east}")))
        with pytest.raises(RedisUnavailableError):
            for seq in range(2, 40):  # until the cluster marks the slot as unserved
                await publisher.publish(_beat("a", "us-east", seq))
                await asyncio.sleep(0.1)
        await publisher.publish(_beat("b", "eu-west", 1))
    finally:
        await publisher.aclose()
        group.stop()
