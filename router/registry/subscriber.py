"""SUBSCRIBE to channels and read their messages straight off the socket.

redis-py's pub/sub path costs ~20 us of CPU per message (a timeout context, a retry
wrapper, push-message handling and a logger lookup for every message); at 40,000
heartbeats per second that alone would take most of a core. Here redis-py only opens
the connection (so TLS, AUTH and every option of the URL work as for any other Redis
call), and the subscription's bytes are parsed with hiredis, every message already
received in one go: ~2 us per message.

A half-open connection (a partitioned server) sends nothing and closes nothing; the
collector's periodic full read, on its own connection with a socket timeout, is what
notices that.

On a Redis/Valkey Cluster (worker.redis_client.is_cluster) the channels are sharded:
SSUBSCRIBE on the node that serves each channel's slot, a connection per node, asked of
the cluster's slot map at every subscription. A slot that moves (a failover, a reshard)
ends the subscription (the server's `sunsubscribe`, or the node's connection closing), and
the caller subscribes again, as after any lost connection.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

import hiredis
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from worker.redis_client import ClusterUnavailable, cluster_unavailable

READ_CHUNK = 1 << 18
SUBSCRIBE_TIMEOUT_S = 2.0
_MESSAGES = (b"message", b"smessage")


class Subscription:
    """`async with Subscription(redis, channels) as sub: payloads = await sub.get(timeout)`.

    `channels`: one channel or several; on a cluster each is SSUBSCRIBEd on its node."""

    def __init__(self, redis: Redis, channels: str | Sequence[str]) -> None:
        self._redis = redis
        self._channels = [channels] if isinstance(channels, str) else list(channels)
        self._nodes: list[_NodeSubscription] = []
        self._fan_in: _FanIn | None = None

    async def __aenter__(self) -> Subscription:
        try:
            if isinstance(self._redis, RedisCluster):
                for connection, channels in await _by_node(self._redis, self._channels):
                    self._nodes.append(_NodeSubscription(connection, channels, sharded=True))
                    await self._nodes[-1].subscribe()
            else:
                # A connection of its own, made from the client's pool settings (URL, TLS,
                # AUTH, connect timeout) but never returned to the pool: it only subscribes.
                connection = self._redis.connection_pool.make_connection()  # type: ignore[no-untyped-call]
                self._nodes.append(_NodeSubscription(connection, self._channels, sharded=False))
                await self._nodes[-1].subscribe()
        except BaseException:
            await self.__aexit__()
            raise
        if len(self._nodes) > 1:
            self._fan_in = _FanIn(self._nodes)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._fan_in is not None:
            await self._fan_in.stop()
        for node in self._nodes:
            await node.close()

    async def get(self, timeout_s: float) -> list[bytes]:
        """The payloads of every message received so far; if there are none, waits up to
        `timeout_s` for some. Raises redis's ConnectionError when a connection ends."""
        if self._fan_in is not None:
            return await self._fan_in.get(timeout_s)
        if not self._nodes:
            return []
        return await self._nodes[0].get(timeout_s)


async def _by_node(redis: RedisCluster, channels: list[str]) -> list[tuple[Any, list[str]]]:
    """A new connection to each node that serves some of `channels`, with its channels,
    from a slot map read now (the last one may predate a failover)."""
    try:
        # (no node reachable, a slot without a node: ClusterUnavailable)
        with cluster_unavailable():
            async with asyncio.timeout(SUBSCRIBE_TIMEOUT_S):
                await redis.nodes_manager.initialize()
            nodes = [redis.get_node_from_key(channel) for channel in channels]
    except TimeoutError:
        raise RedisConnectionError(
            f"the cluster's slot map was not read within {SUBSCRIBE_TIMEOUT_S:g} s") from None
    grouped: dict[str, tuple[Any, list[str]]] = {}
    for channel, node in zip(channels, nodes, strict=True):
        if node is None:
            raise ClusterUnavailable(f"no cluster node serves the channel {channel!r}")
        if node.name not in grouped:
            grouped[node.name] = (node.connection_class(**node.connection_kwargs), [])
        grouped[node.name][1].append(channel)
    return list(grouped.values())


class _NodeSubscription:
    """One connection's subscription, read with hiredis (see the module doc)."""

    def __init__(self, connection: Any, channels: list[str], *, sharded: bool) -> None:
        self._connection = connection
        self._channels = channels
        self._command = "SSUBSCRIBE" if sharded else "SUBSCRIBE"
        self._stream: asyncio.StreamReader | None = None
        self._parser = hiredis.Reader()

    async def subscribe(self) -> None:
        connection = self._connection
        try:
            # Bounded as a whole: a server that accepts but never answers (SIGSTOP, a
            # partition) fails this in SUBSCRIBE_TIMEOUT_S instead of hanging it.
            async with asyncio.timeout(SUBSCRIBE_TIMEOUT_S):
                await connection.connect()
                await connection.send_command(self._command, *self._channels)
                # redis-py has read nothing past its handshake: from here the bytes are ours.
                stream = connection._reader
                if stream is None:
                    raise RedisConnectionError("redis closed the connection while subscribing")
                self._stream = stream
                for _ in self._channels:
                    reply = await self._next_reply(stream)
                    if not isinstance(reply, list) or reply[0] not in (b"subscribe",
                                                                        b"ssubscribe"):
                        raise RedisConnectionError(
                            f"redis refused the subscription: {reply!r}"[:200])
        except TimeoutError:
            raise RedisConnectionError(
                f"redis did not confirm the subscription within {SUBSCRIBE_TIMEOUT_S:g} s"
            ) from None

    async def _next_reply(self, stream: asyncio.StreamReader) -> Any:
        """Subscribed once Redis confirms (callers read their snapshot after this, so no
        update falls between the two); messages after the confirmations stay queued."""
        reply = self._parser.gets()
        while reply is False:
            data = await stream.read(READ_CHUNK)
            if not data:
                raise RedisConnectionError("redis closed the connection while subscribing")
            self._parser.feed(data)
            reply = self._parser.gets()
        return reply

    async def close(self) -> None:
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            async with asyncio.timeout(1.0):
                await self._connection.disconnect()

    async def get(self, timeout_s: float) -> list[bytes]:
        payloads: list[bytes] = []
        self._drain(payloads)
        if payloads or self._stream is None:
            return payloads
        try:
            async with asyncio.timeout(timeout_s):
                data = await self._stream.read(READ_CHUNK)
        except TimeoutError:
            return payloads
        if not data:
            raise RedisConnectionError("redis closed the subscription")
        self._parser.feed(data)
        self._drain(payloads)
        return payloads

    def _drain(self, payloads: list[bytes]) -> None:
        parser = self._parser
        try:
            reply = parser.gets()
            while reply is not False:
                # ["message", channel, payload] ("smessage" sharded); also confirmations.
                if isinstance(reply, list) and len(reply) == 3 and reply[0] in _MESSAGES:
                    payloads.append(reply[2])
                elif isinstance(reply, list) and reply[:1] == [b"sunsubscribe"]:
                    # The channel's slot moved to another node (a failover, a reshard).
                    raise RedisConnectionError("the cluster moved a subscribed channel's slot")
                elif isinstance(reply, hiredis.ReplyError):
                    raise RedisConnectionError(f"redis refused the subscription: {reply}")
                reply = parser.gets()
        except hiredis.ProtocolError as exc:
            raise RedisConnectionError(f"unreadable reply on the subscription: {exc}") from exc


class _FanIn:
    """The messages of several nodes' subscriptions, as one: a reader task per node."""

    def __init__(self, nodes: list[_NodeSubscription]) -> None:
        self._payloads: list[bytes] = []
        self._error: BaseException | None = None
        self._arrived = asyncio.Event()
        self._tasks = [asyncio.create_task(self._read(node)) for node in nodes]

    async def _read(self, node: _NodeSubscription) -> None:
        try:
            while True:
                payloads = await node.get(1.0)
                if payloads:
                    self._payloads.extend(payloads)
                    self._arrived.set()
        except (RedisError, OSError) as exc:
            self._error = exc
            self._arrived.set()

    async def get(self, timeout_s: float) -> list[bytes]:
        if not self._payloads and self._error is None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await self._arrived.wait()
        self._arrived.clear()
        payloads, self._payloads = self._payloads, []
        if not payloads and self._error is not None:
            raise self._error
        return payloads

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
