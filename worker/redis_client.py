"""The one way globalpool opens a Redis connection (workers and routers alike).

redis-py's defaults retry for many seconds against a partitioned server; here every
call fails in about `socket_timeout_s` (plus one quick retry), so callers can fail static
instead of hanging. Works with `redis://`, `rediss://` (TLS) and AUTH in the URL, and with
Redis Sentinel:

    redis+sentinel://[[user]:password@]host:26379[,host:26379...]/SERVICE[/DB]
    rediss+sentinel://...   (TLS to the sentinels and to the primary)

The sentinels are asked for SERVICE's primary whenever a connection is opened, so after a
failover new connections go to the promoted replica; the user and password are the
primary's, and `?sentinel_password=...` (and `sentinel_username`) authenticate to the
sentinels when they require it; with TLS, `?ssl_ca_certs=/path/ca.pem` checks both the
sentinels' and the servers' certificates against that CA.

And with Redis/Valkey Cluster:

    redis+cluster://[[user]:password@]host:6379[,host:6379...][/]
    rediss+cluster://...    (TLS to every node; `?ssl_ca_certs=/path/ca.pem` as above)

The listed nodes are where the client first asks for the slot map; it follows MOVED and
ASK and refreshes the map after a failover. `is_cluster(client)` says which kind a client
is: keys that must share a slot are hash-tagged by their users (see
worker.heartbeat_keys), and pub/sub is sharded (SSUBSCRIBE/SPUBLISH) on a cluster.

Every connection these clients open keeps its task's cancel (worker.redis_cancels).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import parse_qs, unquote, urlsplit, urlunsplit

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException
from redis.typing import KeyT

from worker.redis_cancels import keeping_cancels

PLAIN_SCHEMES = ("redis", "rediss", "unix")
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
SENTINEL_DEFAULT_PORT = 26379
SENTINEL_URL_PARAMETERS = ("sentinel_username", "sentinel_password", "ssl_ca_certs")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
CLUSTER_DEFAULT_PORT = 6379
# A cluster client does not wait for a free connection (it raises at the cap), so each
# node gets this many times the pool size a single server's client waits on.
CLUSTER_CONNECTIONS_FACTOR = 4


def connect(
    url: str,
    *,
    socket_timeout_s: float = 1.0,
    max_connections: int = 16,
    pool_wait_s: float = 1.0,
) -> Redis:
    """A client whose calls raise `redis.exceptions.RedisError` within ~1 s when Redis is gone.

    Pub/sub connections need no socket timeout on reads (they block waiting for messages);
    use `connect_pubsub` for those.
    """
    return _client(
        url,
        max_connections=max_connections,
        timeout=pool_wait_s,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=socket_timeout_s,
        retry=Retry(ExponentialBackoff(cap=0.2, base=0.05), retries=1),
        # No PING before reusing a connection idle for a while: against a hung Redis it
        # is one more timeout before the call's own two (a drain answered 503 after 4.3 s
        # instead of ~2), and a connection the server closed meanwhile fails at once and
        # is retried on a new one anyway.
        health_check_interval=0,
    )


def connect_pubsub(url: str, *, connect_timeout_s: float = 1.0) -> Redis:
    """A client for SUBSCRIBE: bounded connect time, no read timeout (reads wait for messages)."""
    return _client(
        url,
        max_connections=2,
        timeout=connect_timeout_s,
        socket_connect_timeout=connect_timeout_s,
        socket_timeout=None,
        retry=Retry(ExponentialBackoff(cap=0.2, base=0.05), retries=0),
        health_check_interval=5,
    )


def redact_url(url: str) -> str:
    """The URL without its passwords (the server's, and a sentinel's in the query), fit
    for logs."""
    parts = urlsplit(url)
    if parts.query:
        query = "&".join(f"{name}=***" if name.endswith("password") else f"{name}{eq}{value}"
                         for name, eq, value in (p.partition("=") for p in parts.query.split("&")))
        parts = parts._replace(query=query)
    if parts.password is None:
        return urlunsplit(parts)
    user = f"{parts.username}:***@" if parts.username else ":***@"
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=user + host))


def url_problem(url: str) -> str | None:
    """Why `url` cannot be connected to (None: it can), said before anything connects."""
    scheme, separator, rest = url.partition("://")
    if not separator:
        return (f"{url[:80]!r} is not a URL: use redis://host:port, rediss:// (TLS), unix://, "
                "redis+sentinel://host:port/service or redis+cluster://host:port,host:port")
    if scheme in SENTINEL_SCHEMES or scheme in CLUSTER_SCHEMES:
        try:
            (SentinelURL if scheme in SENTINEL_SCHEMES else ClusterURL).parse(url)
        except ValueError as exc:
            return f"{scheme}://: {exc}"
        return None
    if scheme not in PLAIN_SCHEMES:
        return (f"the scheme {scheme[:30]!r} is not supported: use redis://, rediss:// (TLS), "
                "unix://, redis+sentinel:// or redis+cluster:// (rediss+... with TLS)")
    if scheme != "unix" and not rest.rpartition("@")[2].split("/", 1)[0]:
        return f"{scheme}:// needs a host (redis://host:6379/0)"
    return None


def is_cluster(client: Redis) -> bool:
    """Whether `client` talks to a Redis/Valkey Cluster (a `redis+cluster://` URL)."""
    return isinstance(client, RedisCluster)


async def mget(client: Redis, keys: Sequence[KeyT]) -> list[Any]:
    """MGET, on a cluster split by slot (one MGET per slot, not atomic across them)."""
    if isinstance(client, RedisCluster):
        return await client.mget_nonatomic(keys)
    return await client.mget(keys)


def publish(target: Any, channel: str, payload: bytes | str, *, sharded: bool) -> Any:
    """PUBLISH, or SPUBLISH when `sharded` (a cluster: sent to the channel's slot's node,
    not to every node). `target`: a client (await what this returns) or a pipeline."""
    if sharded:
        return target.execute_command("SPUBLISH", channel, payload)
    return target.publish(channel, payload)


async def close(client: Redis) -> None:
    """Close `client` and every connection it holds (a cluster's, on every node)."""
    if isinstance(client, RedisCluster):
        await client.aclose()
    else:
        await client.aclose(close_connection_pool=True)


def is_cluster_url(url: str) -> bool:
    return url.partition("://")[0] in CLUSTER_SCHEMES


def one_slot_prefix(prefix: str, url: str) -> str:
    """The key prefix for state whose keys are used together (in one transaction or
    script: drain flags, files, batches) and whose volume is small: on a cluster
    (`url`), `{prefix}`, a hash tag that puts all of it in one slot; else `prefix`."""
    return f"{{{prefix}}}" if is_cluster_url(url) else prefix


def _client(url: str, **pool_kwargs: Any) -> Redis:
    scheme = url.partition("://")[0]
    if scheme in SENTINEL_SCHEMES:
        client = _sentinel_client(SentinelURL.parse(url), **pool_kwargs)
    elif scheme in CLUSTER_SCHEMES:
        return _cluster_client(ClusterURL.parse(url), **pool_kwargs)
    else:
        client = Redis(connection_pool=BlockingConnectionPool.from_url(
            url, decode_responses=False, **pool_kwargs))
    pool = client.connection_pool
    pool.connection_class = keeping_cancels(pool.connection_class)
    return client


@dataclass(frozen=True)
class SentinelURL:
    """A `redis+sentinel://` URL, parsed (see the module's docstring)."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    tls: bool = False
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None
    ssl_ca_certs: str | None = None  # a CA file to check the servers' certificates with

    @classmethod
    def parse(cls, url: str) -> SentinelURL:
        """Raises ValueError, saying what is wrong, on a malformed URL."""
        parts = urlsplit(url)
        if parts.scheme not in SENTINEL_SCHEMES:
            raise ValueError(f"not a sentinel URL (scheme {parts.scheme!r})")
        credentials, _, hosts = parts.netloc.rpartition("@")
        sentinels = tuple(_host_port(item) for item in hosts.split(",") if item)
        if not sentinels:
            raise ValueError("redis+sentinel:// needs at least one sentinel host[:port]")
        path = [item for item in parts.path.split("/") if item]
        if not path or len(path) > 2:
            raise ValueError("redis+sentinel://HOSTS/SERVICE[/DB]: name the monitored service")
        if len(path) == 2 and not path[1].isdigit():
            raise ValueError(f"the database {path[1][:20]!r} is not a number")
        user, has_password, password = credentials.partition(":")
        query = {key: values[-1] for key, values in parse_qs(parts.query).items()}
        unknown = set(query) - set(SENTINEL_URL_PARAMETERS)
        if unknown:
            raise ValueError(f"unknown URL parameters {sorted(unknown)} (known: "
                             f"{', '.join(SENTINEL_URL_PARAMETERS)})")
        if "ssl_ca_certs" in query and parts.scheme != "rediss+sentinel":
            raise ValueError("ssl_ca_certs needs TLS: rediss+sentinel://")
        return cls(
            sentinels=sentinels, service=unquote(path[0]),
            db=int(path[1]) if len(path) == 2 else 0,
            tls=parts.scheme == "rediss+sentinel",
            username=unquote(user) or None,
            password=unquote(password) if has_password else None,
            sentinel_username=query.get("sentinel_username"),
            sentinel_password=query.get("sentinel_password"),
            ssl_ca_certs=query.get("ssl_ca_certs"),
        )


@dataclass(frozen=True)
class ClusterURL:
    """A `redis+cluster://` URL, parsed (see the module's docstring)."""

    nodes: tuple[tuple[str, int], ...]
    tls: bool = False
    username: str | None = None
    password: str | None = None
    ssl_ca_certs: str | None = None

    @classmethod
    def parse(cls, url: str) -> ClusterURL:
        """Raises ValueError, saying what is wrong, on a malformed URL."""
        parts = urlsplit(url)
        if parts.scheme not in CLUSTER_SCHEMES:
            raise ValueError(f"not a cluster URL (scheme {parts.scheme!r})")
        credentials, _, hosts = parts.netloc.rpartition("@")
        nodes = tuple(_host_port(item, CLUSTER_DEFAULT_PORT) for item in hosts.split(",") if item)
        if not nodes:
            raise ValueError("redis+cluster:// needs at least one node host[:port]")
        if parts.path.strip("/") not in ("", "0"):
            raise ValueError("a cluster has only database 0: redis+cluster://HOSTS/")
        query = {key: values[-1] for key, values in parse_qs(parts.query).items()}
        unknown = set(query) - {"ssl_ca_certs"}
        if unknown:
            raise ValueError(f"unknown URL parameters {sorted(unknown)} (known: ssl_ca_certs)")
        if "ssl_ca_certs" in query and parts.scheme != "rediss+cluster":
            raise ValueError("ssl_ca_certs needs TLS: rediss+cluster://")
        user, has_password, password = credentials.partition(":")
        return cls(nodes=nodes, tls=parts.scheme == "rediss+cluster",
                   username=unquote(user) or None,
                   password=unquote(password) if has_password else None,
                   ssl_ca_certs=query.get("ssl_ca_certs"))


def _host_port(item: str, default_port: int = SENTINEL_DEFAULT_PORT) -> tuple[str, int]:
    if item.startswith("["):  # [IPv6]:port
        host, _, rest = item[1:].partition("]")
        port = rest.removeprefix(":")
    else:
        host, _, port = item.partition(":")
    port = port or str(default_port)
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{item[:60]!r} is not host:port")
    return host, int(port)


class _SentinelBlockingPool(SentinelConnectionPool, BlockingConnectionPool):
    """The primary's connections, found through the sentinels, with the bounded wait for
    a free connection that every other client here has."""


def _tls(on: bool, ca_certs: str | None) -> dict[str, Any]:
    """redis-py's TLS arguments for a URL's `rediss+...` scheme and `ssl_ca_certs`."""
    if not on:
        return {}
    return {"ssl": True} | ({"ssl_ca_certs": ca_certs} if ca_certs else {})


def _sentinel_client(url: SentinelURL, *, max_connections: int, timeout: float | None,
                     **connection_kwargs: Any) -> Redis:
    tls = _tls(url.tls, url.ssl_ca_certs)
    bounded = {key: connection_kwargs[key] for key in ("socket_connect_timeout", "retry")}
    sentinel = Sentinel(  # type: ignore[no-untyped-call]
        list(url.sentinels),
        sentinel_kwargs={**tls, **bounded,
                         "socket_timeout": connection_kwargs["socket_connect_timeout"],
                         "username": url.sentinel_username,
                         "password": url.sentinel_password},
    )
    for asked in sentinel.sentinels:  # (the primary's address is asked under a cancel too)
        asked.connection_pool.connection_class = keeping_cancels(
            asked.connection_pool.connection_class)
    client: Redis = sentinel.master_for(
        url.service, redis_class=Redis, connection_pool_class=_SentinelBlockingPool,
        max_connections=max_connections, timeout=timeout, db=url.db,
        username=url.username, password=url.password, decode_responses=False,
        **tls, **connection_kwargs,
    )
    return client


class ClusterUnavailable(RedisConnectionError):
    """What redis-py raises as `RedisClusterException`, which is not a `RedisError` (no node
    reachable, a slot without a node mid-failover), raised as a Redis connection error:
    every caller's `except RedisError` then fails static as with a single server."""


@contextlib.contextmanager
def cluster_unavailable() -> Iterator[None]:
    """A `RedisClusterException` raised inside, raised as `ClusterUnavailable`."""
    try:
        yield
    except RedisClusterException as exc:
        raise ClusterUnavailable(str(exc)) from exc


class _Cluster(RedisCluster):
    """RedisCluster whose commands and pipelines fail with `RedisError`s only (reading the
    slot map, which every first command and pipeline does, included)."""

    async def initialize(self, *args: Any, **kwargs: Any) -> RedisCluster:
        with cluster_unavailable():
            return await super().initialize(*args, **kwargs)

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        with cluster_unavailable():
            return await super().execute_command(*args, **kwargs)

    def pipeline(self, transaction: Any | None = None,
                 shard_hint: Any | None = None) -> ClusterPipeline:
        if shard_hint:
            raise ValueError("a cluster pipeline takes no shard_hint")
        # (mypy sees ClusterPipeline as abstract: redis-py declares an attribute it sets)
        return _ClusterPipeline(self, transaction)  # type: ignore[abstract]


class _ClusterPipeline(ClusterPipeline):
    async def execute(self, raise_on_error: bool = True,
                      allow_redirections: bool = True) -> list[Any]:
        with cluster_unavailable():
            return await super().execute(raise_on_error, allow_redirections)


def _cluster_client(url: ClusterURL, *, max_connections: int, timeout: float | None,
                    **connection_kwargs: Any) -> Redis:
    del timeout  # a cluster client has no wait for a free connection
    tls = _tls(url.tls, url.ssl_ca_certs)
    client = _Cluster(
        startup_nodes=[ClusterNode(host, port) for host, port in url.nodes],
        # A slot without a node (mid-failover) fails only the calls that need it.
        require_full_coverage=False,
        max_connections=max_connections * CLUSTER_CONNECTIONS_FACTOR,
        username=url.username, password=url.password, decode_responses=False,
        **tls, **connection_kwargs,
    )
    # Its nodes' connections keep cancels too: those made from now on (every node the slot
    # map names: its node manager shares these keyword arguments) and those of the listed
    # nodes, made already.
    keeping = keeping_cancels(client.connection_kwargs["connection_class"])
    client.connection_kwargs["connection_class"] = keeping
    for node in client.nodes_manager.startup_nodes.values():
        node.connection_class = keeping
    # RedisCluster serves the commands globalpool uses with Redis's signatures; the few
    # places that differ (pub/sub, multi-key reads) ask `is_cluster` first.
    return cast(Redis, client)


def raise_if_cancelling() -> None:
    """Re-raise a cancellation that redis-py turned into a Redis error.

    A task cancelled in the middle of a command can see `ConnectionError` or
    `TimeoutError` instead of `CancelledError`; a loop that catches Redis errors and
    retries would then never stop. Call this first in such `except` blocks.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
