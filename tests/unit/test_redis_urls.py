"""The Redis URL forms the router and the agents accept, checked before anything connects
(`worker.redis_client`). Connecting through them is tested on real Valkey processes:
tests/integration/test_redis_sentinel.py, test_security.py (rediss://)."""

from __future__ import annotations

from typing import cast

import pytest
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.asyncio.sentinel import (
    SentinelConnectionPool,
    SentinelManagedConnection,
    SentinelManagedSSLConnection,
)

from router.config import redis_url_problem
from worker.heartbeat_keys import HeartbeatKeys
from worker.redis_cancels import keeping_cancels
from worker.redis_client import (
    ClusterURL,
    SentinelURL,
    connect,
    one_slot_prefix,
    url_problem,
)


def test_a_sentinel_url_names_its_sentinels_service_database_and_credentials() -> None:
    url = SentinelURL.parse("rediss+sentinel://app:p%40ss@10.0.0.1:26380,[::1],sentinel-c/"
                            "gp-main/3?sentinel_password=spw&sentinel_username=watcher")
    assert url.sentinels == (("10.0.0.1", 26380), ("::1", 26379), ("sentinel-c", 26379))
    assert (url.service, url.db, url.tls) == ("gp-main", 3, True)
    assert (url.username, url.password) == ("app", "p@ss")
    assert (url.sentinel_username, url.sentinel_password) == ("watcher", "spw")
    assert SentinelURL.parse("rediss+sentinel://s1/gp?ssl_ca_certs=/etc/gp/ca.pem"
                             ).ssl_ca_certs == "/etc/gp/ca.pem"
    plain = SentinelURL.parse("redis+sentinel://s1/gp")
    assert (plain.db, plain.tls, plain.password, plain.sentinel_password) == (0, False, None, None)


def test_a_cluster_url_names_its_nodes_and_credentials() -> None:
    url = ClusterURL.parse("rediss+cluster://app:p%40ss@10.0.0.1:7001,[::1],node-c/"
                           "?ssl_ca_certs=/etc/gp/ca.pem")
    assert url.nodes == (("10.0.0.1", 7001), ("::1", 6379), ("node-c", 6379))
    assert (url.tls, url.username, url.password, url.ssl_ca_certs) == (
        True, "app", "p@ss", "/etc/gp/ca.pem")
    plain = ClusterURL.parse("redis+cluster://n1:7000")
    assert (plain.tls, plain.username, plain.password) == (False, None, None)


def test_on_a_cluster_each_regions_heartbeat_plane_shares_one_hash_tag() -> None:
    keys = HeartbeatKeys("gp", sharded=True)
    assert keys.worker("w-1", "eu-west") == "gp:hb:{eu-west}:w-1"
    assert keys.loads("eu-west") == "gp:loads:{eu-west}"
    assert keys.region_channel("eu-west") == "gp:heartbeats:{eu-west}"
    assert keys.region_tap("eu-west") == "gp:heartbeats:all:{eu-west}"
    assert keys.channels(["us-east", "eu-west", "us-east"]) == [
        "gp:heartbeats:{eu-west}", "gp:heartbeats:{us-east}"]
    assert keys.worker_id(b"gp:hb:{eu-west}:w-1") == "w-1"
    assert keys.region_of_loads(b"gp:loads:{eu-west}") == "eu-west"
    with pytest.raises(ValueError, match="region"):
        keys.worker("w-1")
    plain = HeartbeatKeys("gp")  # one server: the names they always had
    assert (plain.worker("w-1", "eu-west"), plain.loads("eu-west")) == ("gp:hb:w-1",
                                                                        "gp:loads:eu-west")
    assert plain.channels(["eu-west"]) == ["gp:heartbeats"]
    assert (plain.worker_id(b"gp:hb:w-1"), plain.region_of_loads(b"gp:loads:eu-west")) == (
        "w-1", "eu-west")
    assert one_slot_prefix("gp", "redis+cluster://n1") == "{gp}"
    assert one_slot_prefix("gp", "redis://n1") == "gp"


@pytest.mark.parametrize(("url", "problem"), [
    ("redis+sentinel:///gp", "at least one sentinel"),
    ("redis+sentinel://s1:26379", "name the monitored service"),
    ("redis+sentinel://s1/gp/zero", "is not a number"),
    ("redis+sentinel://s1/gp/0/extra", "name the monitored service"),
    ("redis+sentinel://s1:99999/gp", "is not host:port"),
    ("redis+sentinel://s1/gp?master_password=x", "unknown URL parameters ['master_password']"),
    ("redis+sentinel://s1/gp?ssl_ca_certs=/ca.pem", "ssl_ca_certs needs TLS"),
    ("redis+cluster://", "at least one node"),
    ("redis+cluster://n1:7000/3", "only database 0"),
    ("redis+cluster://n1:70000", "is not host:port"),
    ("redis+cluster://n1?ssl_ca_certs=/ca.pem", "ssl_ca_certs needs TLS"),
    ("rediss+cluster://n1?password=x", "unknown URL parameters ['password']"),
    ("redis+shard://n1:7000", "is not supported"),
    ("redis://:pw@/0", "needs a host"),
    ("localhost:6379", "is not a URL"),
])
def test_malformed_urls_say_what_is_wrong(url: str, problem: str) -> None:
    found = url_problem(url)
    assert found is not None and problem in found
    assert redis_url_problem(url) == found


@pytest.mark.parametrize("url", [
    "redis://h:6379/0", "rediss://:pw@h:6380/1", "unix:///run/redis.sock",
    "redis+sentinel://s1,s2:26380/gp", "rediss+sentinel://:pw@s1/gp/2",
    "redis+cluster://n1:7000,n2:7001", "rediss+cluster://u:pw@n1/?ssl_ca_certs=/ca.pem",
])
def test_the_supported_forms_pass(url: str) -> None:
    assert url_problem(url) is None
    assert redis_url_problem("embedded") is None


@pytest.mark.parametrize("url, kind", [
    ("redis://127.0.0.1:6379/0", Connection),
    ("rediss://127.0.0.1:6380/0", SSLConnection),
    ("unix:///run/valkey.sock", UnixDomainSocketConnection),
    ("redis+sentinel://127.0.0.1:26379/gp", SentinelManagedConnection),
    ("rediss+sentinel://127.0.0.1:26379/gp", SentinelManagedSSLConnection),
])
async def test_every_kind_of_connection_keeps_its_tasks_cancel(url: str, kind: type) -> None:
    # (What keeping the cancel does is shown on a real Valkey: tests/integration/
    # test_redis_client_timeouts.py; here: that each URL form's connections do it.)
    client = connect(url)
    try:
        made = client.connection_pool.connection_class
        assert issubclass(made, kind) and made is keeping_cancels(kind), made
        if "sentinel" in url:  # and those that ask the sentinels for the primary
            pool = cast(SentinelConnectionPool, client.connection_pool)
            sentinels = pool.sentinel_manager.sentinels
            assert len(sentinels) == 1
            plain = SSLConnection if url.startswith("rediss") else Connection
            assert [asked.connection_pool.connection_class for asked in sentinels] == [
                keeping_cancels(plain)]
    finally:
        await client.aclose()


@pytest.mark.parametrize("url, kind", [
    ("redis+cluster://127.0.0.1:7001,127.0.0.1:7002", Connection),
    ("rediss+cluster://127.0.0.1:7001", SSLConnection),
])
async def test_a_clusters_connections_keep_their_tasks_cancel(
        url: str, kind: type[Connection]) -> None:
    client = cast(RedisCluster, connect(url))
    try:
        keeping = keeping_cancels(kind)
        assert client.nodes_manager.connection_kwargs["connection_class"] is keeping
        assert [node.connection_class for node in client.nodes_manager.startup_nodes.values()
                ] == [keeping] * len(url.split(","))
    finally:
        await client.aclose()
