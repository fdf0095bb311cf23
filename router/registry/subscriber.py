"""SUBSCRIBE to one channel and read its messages straight off the socket.

redis-py's pub/sub path costs ~20 us of CPU per message (a timeout context, a retry
wrapper, push-message handling and a logger lookup for every message); at 40,000
heartbeats per second that alone would take most of a core. Here redis-py only opens
the connection (so TLS, AUTH and every option of the URL work as for any other Redis
call), and the subscription's bytes are parsed with hiredis, every message already
received in one go: ~2 us per message.

A half-open connection (a partitioned server) sends nothing and closes nothing; the
collector's periodic full read, on its own connection with a socket timeout, is what
notices that.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import hiredis
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

READ_CHUNK = 1 << 18
SUBSCRIBE_TIMEOUT_S = 2.0


class Subscription:
    """`async with Subscription(redis, channel) as sub: payloads = await sub.get(timeout)`."""

    def __init__(self, redis: Redis, channel: str) -> None:
        self._redis = redis
        self._channel = channel
        self._connection: Any = None
        self._stream: asyncio.StreamReader | None = None
        self._parser = hiredis.Reader()

    async def __aenter__(self) -> Subscription:
        # A connection of its own, made from the client's pool settings (URL, TLS, AUTH,
        # connect timeout) but never returned to the pool: it only ever subscribes.
        connection = self._redis.connection_pool.make_connection()  # type: ignore[no-untyped-call]
        self._connection = connection
        try:
            # Bounded as a whole: a server that accepts but never answers (SIGSTOP, a
            # partition) fails this in SUBSCRIBE_TIMEOUT_S instead of hanging it.
            async with asyncio.timeout(SUBSCRIBE_TIMEOUT_S):
                await connection.connect()
                await connection.send_command("SUBSCRIBE", self._channel)
                # redis-py has read nothing past its handshake: from here the bytes are ours.
                stream = connection._reader
                if stream is None:
                    raise RedisConnectionError("redis closed the connection while subscribing")
                self._stream = stream
                reply = await self._first_reply(stream)
            if not isinstance(reply, list) or reply[:1] != [b"subscribe"]:
                raise RedisConnectionError(f"redis refused the subscription: {reply!r}"[:200])
        except TimeoutError:
            await self.__aexit__()
            raise RedisConnectionError(
                f"redis did not confirm the subscription within {SUBSCRIBE_TIMEOUT_S:g} s"
            ) from None
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def _first_reply(self, stream: asyncio.StreamReader) -> Any:
        """Subscribed once Redis confirms (callers read their snapshot after this, so no
        update falls between the two); messages after the confirmation stay queued."""
        reply = self._parser.gets()
        while reply is False:
            data = await stream.read(READ_CHUNK)
            if not data:
                raise RedisConnectionError("redis closed the connection while subscribing")
            self._parser.feed(data)
            reply = self._parser.gets()
        return reply

    async def __aexit__(self, *exc_info: object) -> None:
        if self._connection is not None:
            with contextlib.suppress(RedisError, OSError, TimeoutError):
                await asyncio.wait_for(self._connection.disconnect(), timeout=1.0)

    async def get(self, timeout_s: float) -> list[bytes]:
        """The payloads of every message received so far; if there are none, waits up to
        `timeout_s` for some. Raises redis's ConnectionError when the connection ends."""
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
                # ["message", channel, payload]; also ["subscribe", channel, count].
                if isinstance(reply, list) and len(reply) == 3 and reply[0] == b"message":
                    payloads.append(reply[2])
                elif isinstance(reply, hiredis.ReplyError):
                    raise RedisConnectionError(f"redis refused the subscription: {reply}")
                reply = parser.gets()
        except hiredis.ProtocolError as exc:
            raise RedisConnectionError(f"unreadable reply on the subscription: {exc}") from exc
