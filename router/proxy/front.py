"""The router's HTTP/1.1 front: inference requests on raw asyncio protocols.

aiohttp's server costs more per request than a whole compiled router (BENCHMARKS.md,
"Proxy cost"), so the request path does not go through it. `FrontSite`
(`router.proxy.site`) listens in its place; each connection is a `FrontProtocol` that
parses request heads itself, hands `POST /v1/chat/completions`, `/v1/completions` and
`/v1/embeddings` to the proxy as an `Exchange`, writes whole answers with one
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
import time
from collections.abc import Callable, Coroutine, Mapping
from email.utils import formatdate
from http import HTTPStatus
from typing import Any, ClassVar, Protocol, cast

from router.core.errors import ApiError
from router.proxy.exchange import InferenceHandler, error_reply
from router.proxy.transcript import Transcript, chunk_payloads, framed
from router.proxy.upstream.connection import UpstreamConnection
from router.proxy.upstream.errors import UpstreamError
from router.proxy.upstream.response_head import UNIQUE_VALUE_HEADERS, remember_line
from router.proxy.upstream.sinks import Sink

log = logging.getLogger("globalpool.front")

INFERENCE_PATHS = {path: path for path in
                   ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")}
# Headers that may appear once: a repeated one goes to aiohttp's stricter parser.
_SINGLE_HEADERS = frozenset({"content-length", "host", "authorization"})
# A request head longer than this goes to aiohttp, whose limits answer it.
MAX_HEAD_BYTES = 16 * 1024
# A connection whose head is late is closed this long after header_s, once the loop has
# read the sockets again (see FrontProtocol._check_head).
HEAD_GRACE_S = 0.05
# The name of a connection's task (one per connection, serving its requests in turn).
TASK_NAME = "front-connection"
# Bytes of later requests read ahead while one is served; reading pauses beyond.
READ_AHEAD_BYTES = 256 * 1024
# After refusing a request whose body is still coming: how long, and how many of its
# bytes, the router reads and drops before it closes (see FrontProtocol._linger).
LINGER_S = 5.0
LINGER_MAX_BYTES = 64 * 1024 * 1024

# The request lines the front serves, and the path each asks for.
_REQUEST_LINES = {f"POST {path} HTTP/1.1": path for path in INFERENCE_PATHS}
# Header lines seen before, parsed: (lower-case name, value). Clients repeat most of
# theirs request after request (Host, Content-Type, Accept, User-Agent, Content-Length of
# a common size), and a lookup costs a third of parsing one. Bounded as the answers'
# table is (router.proxy.upstream.remember_line: 1 MB at worst, whatever clients send);
# lines that carry credentials, or a value new in every request, are never kept.
_HEADER_LINES: dict[str, tuple[str, str]] = {}
_SECRET_HEADERS = frozenset({"authorization", "proxy-authorization", "cookie", "x-api-key",
                             "api-key"})
_NOT_KEPT = _SECRET_HEADERS | UNIQUE_VALUE_HEADERS


def _header_field(line: str) -> tuple[str, str] | None:
    """(lower-case name, value) of a header line; None if it is malformed or folded."""
    name, colon, value = line.partition(":")
    if not colon or not name or name[0] in " \t" or name[-1] in " \t":
        return None
    field = (name.lower(), value.strip(" \t"))
    if field[0] not in _NOT_KEPT:
        remember_line(_HEADER_LINES, line, field)
    return field


# "HTTP/1.1 200 OK\r\n" for every status Python names; others are "Unknown".
_STATUS_LINES = {status.value: f"HTTP/1.1 {status.value} {status.phrase}\r\n"
                 for status in HTTPStatus}
_LAST_CHUNK = b"0\r\n\r\n"
_CRLF = "\r\n"


class _Clock:
    """The `Date` header, with the `Server` header after it, formatted once per second."""

    second: ClassVar[int] = 0
    value: ClassVar[str] = ""

    @classmethod
    def date(cls) -> str:
        """`Date: ...\r\nServer: globalpool\r\n` for the current second."""
        now = int(time.time())
        if now != cls.second:
            cls.second = now
            cls.value = f"Date: {formatdate(now, usegmt=True)}\r\nServer: globalpool\r\n"
        return cls.value


def _head(status: int, headers: Mapping[str, str], framing: str, close: bool) -> bytes:
    status_line = _STATUS_LINES.get(status) or f"HTTP/1.1 {status} Unknown\r\n"
    lines = "\r\n".join(map(": ".join, headers.items()))  # the loop in C
    connection = "Connection: close\r\n" if close else ""
    return (f"{status_line}{lines}{_CRLF if lines else ''}{_Clock.date()}{framing}{connection}"
            "\r\n").encode("latin-1", "replace")


class FrontExchange:
    """One inference request on a front connection (see `router.proxy.exchange`)."""

    __slots__ = ("_protocol", "_transcript", "content_length", "headers", "path", "started")

    def __init__(self, protocol: FrontProtocol, path: str, headers: dict[str, str],
                 content_length: int) -> None:
        self._protocol = protocol
        self.path = path
        self.headers = headers
        self.content_length = content_length
        self.started = False  # the answer's head has been written
        self._transcript: Transcript | None = None  # kept while relaying (see `relay`)

    def body_if_here(self) -> bytes | None:
        return self._protocol.body_if_here(self.content_length)

    def read_body(self, timeout_s: float) -> Coroutine[Any, Any, bytes]:
        return self._protocol.read_body(self.content_length, timeout_s)  # one await less

    async def relay(
        self, headers: Mapping[str, str], first: bytes, upstream: UpstreamConnection,
        transcript: Transcript | None = None,
    ) -> UpstreamError | None:
        protocol = self._protocol
        transport = protocol.transport
        if transport.is_closing():
            raise ConnectionResetError("the client went away")
        self.started = True
        head = _head(200, headers, "Transfer-Encoding: chunked\r\n", protocol.closing)
        if transcript is None:
            transport.write(head + framed(first) if first else head)
        else:
            try:
                transport.write(head + transcript.admit_framed(first))
            except UpstreamError as exc:  # an error event right after the first
                transport.write(head)
                return exc
        self._transcript = transcript
        try:
            return await self._pipe(upstream, self)
        finally:
            self._transcript = None

    async def relay_more(
        self, first: bytes, upstream: UpstreamConnection, rewrite: Callable[[bytes], bytes]
    ) -> UpstreamError | None:
        if self._protocol.transport.is_closing():
            raise ConnectionResetError("the client went away")
        sink = _Rewriting(self, rewrite)
        try:
            sink.write(first)
        except UpstreamError as exc:
            return exc
        return await self._pipe(upstream, sink)

    async def _pipe(self, upstream: UpstreamConnection, sink: Sink) -> UpstreamError | None:
        protocol = self._protocol
        protocol.relaying = upstream
        if protocol.writing_paused:
            upstream.pause_reading()
        try:
            await upstream.pipe(sink)
        except UpstreamError as exc:
            return exc
        finally:
            protocol.relaying = None
        transcript = self._transcript
        if transcript is not None:
            tail = transcript.take_held()
            if tail:
                self._chunk(tail)
        return None

    def write(self, data: bytes) -> None:
        """The upstream's next body bytes, as one HTTP chunk (called by the upstream)."""
        transcript = self._transcript
        # Whole events only (raises: the stream breaks), framed once for both.
        chunk = framed(data) if transcript is None else transcript.admit_framed(data)
        transport = self._protocol.transport
        if chunk and not transport.is_closing():
            transport.write(chunk)

    def _chunk(self, data: bytes) -> None:
        transport = self._protocol.transport
        if not transport.is_closing():
            transport.write(framed(data))

    def write_frame(self, frame: bytes) -> None:
        """One whole HTTP chunk of the upstream's, passed on as it came."""
        transcript = self._transcript
        if transcript is not None and not transcript.admit_frame(frame):
            for payload in chunk_payloads(frame):
                self.write(payload)
            return
        transport = self._protocol.transport
        if not transport.is_closing():
            transport.write(frame)

    def client_pending_bytes(self) -> int:
        return self._protocol.transport.get_write_buffer_size()

    def abort_client(self) -> None:
        self._protocol.transport.abort()

    async def end_stream(self, tail: bytes, server_timing: str | None = None) -> None:
        transport = self._protocol.transport
        last = _LAST_CHUNK if server_timing is None else (
            b"0\r\nserver-timing: " + server_timing.encode("latin-1", "replace") + b"\r\n\r\n")
        if tail:
            transport.write(b"%x\r\n" % len(tail) + tail + b"\r\n" + last)
        else:
            transport.write(last)


class _Rewriting:
    """A sink that passes a continuation's body through `rewrite` to the client."""

    __slots__ = ("_exchange", "_rewrite")

    def __init__(self, exchange: FrontExchange, rewrite: Callable[[bytes], bytes]) -> None:
        self._exchange = exchange
        self._rewrite = rewrite

    def write(self, data: bytes) -> None:
        out = self._rewrite(data)
        if out:
            self._exchange._chunk(out)


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
        if end < 0:
            if len(buffer) > MAX_HEAD_BYTES:
                self._hand_over()
            return
        request = self._parse_head(bytes(buffer[:end]))
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

    @staticmethod
    def _parse_head(head: bytes) -> tuple[str, dict[str, str], int, bool] | None:
        """(path, headers, body length, close) of a request the front serves; None for
        anything else (aiohttp takes it)."""
        text = head.decode("latin-1")
        lines = text.split("\r\n")
        breaks = len(lines) - 1
        if text.count("\n") != breaks or text.count("\r") != breaks or "\x00" in text:
            return None  # a bare CR or LF, or a NUL: not ours to interpret
        path = _REQUEST_LINES.get(lines[0])  # POST, an inference path, HTTP/1.1
        if path is None:
            return None
        headers: dict[str, str] = {}
        known = _HEADER_LINES
        for line in lines[1:]:
            field = known.get(line)
            if field is None:
                field = _header_field(line)
                if field is None:
                    return None
            key, value = field
            if key in headers:
                if key in _SINGLE_HEADERS:
                    return None
                value = f"{headers[key]}, {value}"
            headers[key] = value
        if "transfer-encoding" in headers or "expect" in headers or "upgrade" in headers:
            return None
        raw_length = headers.get("content-length", "0")
        if not raw_length.isdigit() or not raw_length.isascii() or len(raw_length) > 12:
            return None
        close = "close" in headers.get("connection", "").lower()
        return path, headers, int(raw_length), close

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
            waiter = self._body_waiter = self._loop.create_future()
            try:
                async with asyncio.timeout(timeout_s):
                    await waiter
            except TimeoutError:
                raise ApiError(408, "the request body did not arrive within "
                               f"{timeout_s:g} s") from None
            finally:
                self._body_waiter = None
        body = bytes(self._buffer[:length])
        del self._buffer[:length]
        self._body_left = 0
        return body

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
            transport.write(_head(reply.status, reply.headers,
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
            self._timer = self._loop.call_later(HEAD_GRACE_S, self._check_head)
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

    def close_when_idle(self) -> None:
        """Shutting down: close now if no request is being served, else after it."""
        self.closing = True
        if self._exchange is None:
            self.transport.close()

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
