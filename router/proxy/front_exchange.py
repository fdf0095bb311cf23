"""One inference request on a front connection, and the answers the front writes.

`FrontExchange` is the front's `Exchange` (see `router.proxy.exchange`): the request's
head and body, a whole answer written with one `transport.write` (`answer_head`), and a
stream relayed from the upstream connection's `data_received` straight to the client's
transport as HTTP chunks (no task wake-up per chunk).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Mapping
from email.utils import formatdate
from http import HTTPStatus
from typing import Any, ClassVar, Protocol

from router.proxy.transcript import Transcript, chunk_payloads, framed
from router.proxy.upstream.connection import UpstreamConnection
from router.proxy.upstream.errors import UpstreamError
from router.proxy.upstream.sinks import Sink

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


def answer_head(status: int, headers: Mapping[str, str], framing: str, close: bool) -> bytes:
    """An answer's head: the status line, `headers`, Date and Server, `framing` (its
    Content-Length or Transfer-Encoding line) and `Connection: close` if `close`."""
    status_line = _STATUS_LINES.get(status) or f"HTTP/1.1 {status} Unknown\r\n"
    lines = "\r\n".join(map(": ".join, headers.items()))  # the loop in C
    connection = "Connection: close\r\n" if close else ""
    return (f"{status_line}{lines}{_CRLF if lines else ''}{_Clock.date()}{framing}{connection}"
            "\r\n").encode("latin-1", "replace")


class Connection(Protocol):
    """What an exchange needs of the connection it came on (router.proxy.front)."""

    transport: asyncio.Transport
    closing: bool  # answer this request, then close
    writing_paused: bool  # the client's transport asked us to stop writing
    relaying: UpstreamConnection | None  # the stream it relays now, paused with the client

    def body_if_here(self, length: int) -> bytes | None: ...

    async def read_body(self, length: int, timeout_s: float) -> bytes: ...


class FrontExchange:
    """One inference request on a front connection (see `router.proxy.exchange`)."""

    __slots__ = ("_protocol", "_transcript", "_transport", "content_length", "headers", "path",
                 "started")
    paced = False

    def __init__(self, protocol: Connection, path: str, headers: dict[str, str],
                 content_length: int) -> None:
        self._protocol = protocol
        self._transport = protocol.transport  # (the chunks' way out, at hand)
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
        transport = self._transport
        if transport.is_closing():
            raise ConnectionResetError("the client went away")
        self.started = True
        head = answer_head(200, headers, "Transfer-Encoding: chunked\r\n",
                           self._protocol.closing)
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
        if self._transport.is_closing():
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
            try:
                tail = transcript.take_held()
            except UpstreamError as exc:  # the body ended inside an event
                return exc
            if tail:
                self._chunk(tail)
        return None

    def write(self, data: bytes) -> None:
        """The upstream's next body bytes, as one HTTP chunk (called by the upstream)."""
        transcript = self._transcript
        # Whole events only (raises: the stream breaks), framed once for both.
        chunk = framed(data) if transcript is None else transcript.admit_framed(data)
        transport = self._transport
        if chunk and not transport.is_closing():
            transport.write(chunk)

    def _chunk(self, data: bytes) -> None:
        transport = self._transport
        if not transport.is_closing():
            transport.write(framed(data))

    def write_frame(self, frame: bytes) -> None:
        """One whole HTTP chunk of the upstream's, passed on as it came."""
        transcript = self._transcript
        if transcript is not None and not transcript.admit_frame(frame):
            for payload in chunk_payloads(frame):
                self.write(payload)
            return
        transport = self._transport
        if not transport.is_closing():
            transport.write(frame)

    def client_pending_bytes(self) -> int:
        return self._transport.get_write_buffer_size()

    def abort_client(self) -> None:
        self._transport.abort()

    async def end_stream(self, tail: bytes, server_timing: str | None = None) -> None:
        transport = self._transport
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
