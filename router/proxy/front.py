"""The router's HTTP/1.1 front: inference requests on raw asyncio protocols.

aiohttp's server costs more per request than a whole compiled router (BENCHMARKS.md,
"Proxy cost"), so the request path does not go through it. `FrontSite`
(`router.proxy.site`) listens in its place; each connection is a `FrontProtocol` that
parses request heads itself (`router.proxy.front_head`), hands a `POST` to an inference
endpoint (router.core.endpoints: chat, completions, embeddings, rerank, ...) to the proxy
as an `Exchange` (`router.proxy.front_exchange.FrontExchange`), writes whole answers with one
`transport.write`, and relays streams from the upstream connection's `data_received`
straight to the client's transport (no task wake-up per chunk; the client's flow control
pauses the upstream).

Everything else is aiohttp's: at a request boundary, a connection whose next request is
anything but a plain HTTP/1.1 inference POST with a Content-Length body (the admin API,
the status page, metrics, chunked or `Expect` uploads, HTTP/1.0, a malformed head) is
handed over to aiohttp's request handler with the bytes it has not read, and stays there.
aiohttp serves the same routes, so a handed-over connection is slower, never different.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Protocol, cast

from router.core.errors import ApiError
from router.proxy.exchange import STALL_GRACE_S, InferenceHandler, error_reply
from router.proxy.front_exchange import FrontExchange, answer_head
from router.proxy.front_head import parse_head
from router.proxy.upstream.connection import UpstreamConnection

log = logging.getLogger("globalpool.front")

# A request head longer than this (or of more than front_head.MAX_HEADERS headers) goes
# to aiohttp, whose limits answer it.
MAX_HEAD_BYTES = 16 * 1024
# The name of a connection's task (one per connection, serving its requests in turn).
TASK_NAME = "front-connection"
# Bytes of later requests read ahead while one is served; reading pauses beyond.
READ_AHEAD_BYTES = 256 * 1024
# After refusing a request whose body is still coming: how long, and how many of its
# bytes, the router reads and drops before it closes (see FrontProtocol._linger).
LINGER_S = 5.0
LINGER_MAX_BYTES = 64 * 1024 * 1024
# Stopping: how long a connection that has not sent its first request yet (or is part way
# through a head) is kept for it. Its client opened it to send one: closing it would
# fail that request (Go's http.Server.Shutdown waits 5 s too).
FIRST_REQUEST_GRACE_S = 5.0


class Listener(Protocol):
    """What a connection needs of the site that accepted it (router.proxy.site.FrontSite)."""

    handler: InferenceHandler
    header_timeout_s: float
    stopping: bool
    connections: set[FrontProtocol]

    def closed(self, connection: FrontProtocol) -> None: ...

    def aiohttp_protocol(self) -> asyncio.Protocol: ...


class FrontProtocol(asyncio.Protocol):
    """One client connection: keep-alive, one request at a time, pipelined ones queued."""

    def __init__(self, site: Listener) -> None:
        self._site = site
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport = cast(asyncio.Transport, None)
        self._buffer = bytearray()
        # One task serves the connection's requests one after another (see
        # _serve_requests); `_exchange` is the request it serves now (None: idle).
        self._task: asyncio.Task[None] | None = None
        self._exchange: FrontExchange | None = None
        self._next_head: asyncio.Future[None] | None = None  # the idle task waits on it
        self._handed_over = False  # to aiohttp: the task ends
        self._body_waiter: asyncio.Future[None] | None = None
        self._body_left = 0  # bytes of the current request's body not yet taken
        self._timer: asyncio.TimerHandle | None = None  # see _await_head
        self._head_due_s = 0.0  # the next request head must have come by then
        self._head_grace = False  # past _head_due_s, looking once more
        self._reading_paused = False
        self.writing_paused = False
        self.relaying: UpstreamConnection | None = None
        self.closing = False  # answer this request, then close
        self._lingering_left = 0  # after a refusal: bytes still to drop (see _linger)

    # -- asyncio.Protocol --
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._site.connections.add(self)
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._site.closed(self)
        self._cancel_timer()
        if self._task is not None:
            self._task.cancel()  # the client went away: so does its request, if any
        waiter = self._body_waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(ConnectionResetError("the client went away"))

    def data_received(self, data: bytes) -> None:
        if self._lingering_left:
            self._discard(len(data))
            return
        self._buffer += data
        if self._exchange is None:
            self._next_request()
            return
        waiter = self._body_waiter
        if waiter is None:  # read ahead, but not without bound
            limit = READ_AHEAD_BYTES
        else:  # the request's body is awaited: it may be bigger (up to max_body_bytes)
            limit = max(READ_AHEAD_BYTES, self._body_left)
            if len(self._buffer) >= self._body_left and not waiter.done():
                waiter.set_result(None)
        if len(self._buffer) > limit:
            self.transport.pause_reading()
            self._reading_paused = True

    def eof_received(self) -> bool | None:
        return None  # close: a client that stops sending is gone

    def pause_writing(self) -> None:
        self.writing_paused = True
        if self.relaying is not None:
            self.relaying.pause_reading()

    def resume_writing(self) -> None:
        self.writing_paused = False
        if self.relaying is not None:
            self.relaying.resume_reading()

    # -- requests --
    def _next_request(self) -> None:
        buffer = self._buffer
        end = buffer.find(b"\r\n\r\n")
        if end < 0 or end > MAX_HEAD_BYTES:
            if end >= 0 or len(buffer) > MAX_HEAD_BYTES:
                self._hand_over()
            return
        request = parse_head(bytes(buffer[:end]))
        if request is None:
            self._hand_over()
            return
        del buffer[: end + 4]
        path, headers, length, close = request
        self._body_left = length
        self.closing = close or self._site.stopping
        self._exchange = FrontExchange(self, path, headers, length)
        if self._task is None:
            self._task = self._loop.create_task(self._serve_requests(), name=TASK_NAME)
        else:
            self._wake_task()  # unless it is the task itself, at a request's end

    def body_if_here(self, length: int) -> bytes | None:
        buffer = self._buffer
        if len(buffer) < length:
            return None
        body = bytes(buffer[:length])
        del buffer[:length]
        self._body_left = 0
        return body

    async def read_body(self, length: int, timeout_s: float) -> bytes:
        if len(self._buffer) < length:
            self._resume_reading()
            # A body that came while the host stalled this process: see STALL_GRACE_S.
            if not (await self._body_came(length, timeout_s)
                    or await self._body_came(length, STALL_GRACE_S)):
                raise ApiError(408, "the request body did not arrive within "
                               f"{timeout_s:g} s")
        body = bytes(self._buffer[:length])
        del self._buffer[:length]
        self._body_left = 0
        return body

    async def _body_came(self, length: int, timeout_s: float) -> bool:
        """Whether the buffer holds `length` bytes of body within `timeout_s`."""
        if len(self._buffer) >= length:
            return True
        waiter = self._body_waiter = self._loop.create_future()
        try:
            async with asyncio.timeout(timeout_s):
                await waiter
        except TimeoutError:
            return False
        finally:
            self._body_waiter = None
        return True

    async def _serve_requests(self) -> None:
        """The connection's requests, one after another, in one task: a task per request
        cost several microseconds more (making it, registering it in asyncio's set of
        tasks and out again). Ends when the connection closes or is handed over."""
        while True:
            exchange = self._exchange
            if exchange is not None:
                await self._serve(exchange)
                continue
            if self._handed_over or self.transport.is_closing():
                return
            waiter = self._next_head = self._loop.create_future()
            try:
                await waiter  # a request came, or the connection was handed over
            finally:
                self._next_head = None

    def _wake_task(self) -> None:
        """Wake the idle task: a request is there, or the connection was handed over."""
        waiter = self._next_head
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _serve(self, exchange: FrontExchange) -> None:
        try:
            reply = await self._site.handler(exchange)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("request on %s failed", exchange.path)
            if exchange.started:
                self.transport.abort()  # a stream cut off: the client sees it end early
                return
            reply = error_reply(500, "internal error in the router")
        finally:
            self._exchange = None
        unread = 0
        if self._body_left:  # not read (refused first): drop it, or the connection
            if len(self._buffer) >= self._body_left:
                del self._buffer[: self._body_left]
                self._body_left = 0
            else:
                self.closing = True
                unread = self._body_left - len(self._buffer)
        transport = self.transport
        if not reply.streamed:
            body = reply.body
            transport.write(answer_head(reply.status, reply.headers,
                                        f"Content-Length: {len(body)}\r\n", self.closing) + body)
        if unread and not transport.is_closing():
            self._linger(unread)
            return
        if self.closing or transport.is_closing():
            transport.close()
            return
        self._await_head()
        self._resume_reading()
        if self._buffer:
            self._next_request()

    # -- connection upkeep --
    def _await_head(self) -> None:
        """Close a connection whose next request head does not arrive within header_s.

        One timer per connection, not one per request: it is moved forward only when it
        fires early (the connection served requests meanwhile), which saves creating
        and cancelling a timer for every request."""
        self._head_due_s = self._loop.time() + self._site.header_timeout_s
        self._head_grace = False
        if self._timer is None:
            self._timer = self._loop.call_at(self._head_due_s, self._check_head)

    def _check_head(self) -> None:
        self._timer = None
        if self._exchange is not None:
            return  # a request is being served: its end calls _await_head
        now = self._loop.time()
        if now < self._head_due_s:
            self._timer = self._loop.call_at(self._head_due_s, self._check_head)
        elif not self._head_grace:
            # After the host stalled this process, the loop runs expired timers before it
            # reads the sockets: a head that arrived meanwhile is not seen yet. Look again
            # after the next read of the sockets before closing.
            self._head_grace = True
            self._timer = self._loop.call_later(STALL_GRACE_S, self._check_head)
        elif self.transport.get_write_buffer_size():
            # The last answer is still unread: a client that stopped reading. close()
            # would keep its bytes until it reads them, perhaps never.
            self.transport.abort()
        else:
            self.transport.close()

    def _linger(self, unread: int) -> None:
        """Close after a refusal (a 413, a 401) whose body the client is still sending:
        half-close (our answer, then FIN) and read and drop what it still sends, for at
        most LINGER_S and its body's bytes. Closing at once would make the kernel answer
        the unread bytes with a reset, which can destroy our answer before the client
        reads it: it would see "connection reset", not the 413 (nginx's lingering close)."""
        self._cancel_timer()
        self._buffer.clear()
        self._lingering_left = min(unread, LINGER_MAX_BYTES) + 1
        self._resume_reading()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._timer = self._loop.call_later(LINGER_S, self.transport.close)

    def _discard(self, size: int) -> None:
        self._lingering_left -= size
        if self._lingering_left <= 0:
            self.transport.close()  # more than the body it announced: enough

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _resume_reading(self) -> None:
        if self._reading_paused:
            self._reading_paused = False
            self.transport.resume_reading()

    def serving(self) -> str | None:
        """The path of the request this connection serves now (None: idle)."""
        exchange = self._exchange
        return None if exchange is None else exchange.path

    def close_when_idle(self) -> None:
        """Shutting down: close now if idle between requests, else after the request it
        serves. A connection whose first request has not come yet (no task: see
        _next_request), or whose next head is part way in, is kept for that request (and
        closed after it) up to FIRST_REQUEST_GRACE_S: a client that has just connected
        is about to send one, and would see the connection break."""
        self.closing = True
        if self._exchange is not None:
            return
        if self._task is not None and not self._buffer:
            self.transport.close()
            return
        due_s = self._loop.time() + FIRST_REQUEST_GRACE_S
        if due_s < self._head_due_s:
            self._cancel_timer()
            self._head_due_s = due_s
            self._head_grace = False
            self._timer = self._loop.call_at(due_s, self._check_head)

    def _hand_over(self) -> None:
        """From here on aiohttp serves this connection, starting with the unread bytes."""
        self._cancel_timer()
        self._handed_over = True
        self._wake_task()
        self._site.closed(self)
        handler = self._site.aiohttp_protocol()
        transport, data = self.transport, bytes(self._buffer)
        self._buffer.clear()
        transport.set_protocol(handler)
        handler.connection_made(transport)
        if data:
            handler.data_received(data)
        self._resume_reading()
