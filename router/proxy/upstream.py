"""A small HTTP/1.1 keep-alive client for the hot path to the upstream workers.

aiohttp's ClientSession costs too much CPU per request for a router whose whole job is to
forward. This client is a plain asyncio Protocol (the default loop and uvloop alike) that
sends a pre-encoded request (`encode_request`) and parses only what a proxy needs: the
status, the headers, and the body framing (Content-Length, chunked, or until close).

A body is either read (`read_some`, `read_all`) or piped: `pipe(sink)` hands every decoded
body byte to `sink.write` straight from `data_received`, one call per read from the socket,
so that a streamed answer costs no task wake-up per chunk.

Connections are kept per (host, port) in an `UpstreamPool`, most recently used first, and
closed after `keepalive_s` idle: shorter than the workers' own keep-alive (uvicorn: 5 s) so
that we, not they, close an idle connection. When they do close one first, the next request
on it fails with `ConnectionBroken(stale=True)`, and the caller resends it at once.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import socket
import ssl as ssl_module
import typing
from collections.abc import Iterable, Mapping
from http import HTTPStatus
from typing import cast

MAX_HEAD_BYTES = 64 * 1024  # the status line and headers (and, apart, a chunked trailer)
MAX_BUFFER_BYTES = 1024 * 1024  # body bytes held for a reader before reading is paused
_MAX_CHUNK_LINE_BYTES = 4096  # a chunk-size line with its extensions
_HEX_DIGITS = b"0123456789abcdefABCDEF"
# Each byte's value as a hex digit, -1 for the others (`_bare_size`).
_HEX_VALUES = tuple(int(chr(byte), 16) if bytes([byte]) in _HEX_DIGITS else -1
                    for byte in range(256))
_SWEEP_SLACK_S = 0.005  # the sweeper may close a connection this much early (timer rounding)
# A connect whose deadline passed is looked at once more this much later (see _connect).
CONNECT_GRACE_S = 0.05

# Where the parser is in the answer.
_IDLE = 0  # no request outstanding
_HEAD = 1  # the status line and headers
_LENGTH = 2  # a body of Content-Length bytes (_left: bytes still to come)
_CHUNK_SIZE = 3  # a chunk-size line
_CHUNK_DATA = 4  # chunk data (_left: bytes still to come)
_CHUNK_CRLF = 5  # the CRLF after chunk data (_left: 2 or 1 bytes of it still to come)
_TRAILERS = 6  # trailer lines after the last chunk (_left: trailer bytes so far)
_UNTIL_CLOSE = 7  # a body that ends when the connection closes
_DONE = 8  # the whole answer has arrived


class UpstreamError(Exception):
    """Base of the errors talking to an upstream worker."""


class ConnectFailed(UpstreamError):
    """The TCP connection could not be made: refused, unreachable, or timed out.

    No byte of the request left, so it is always safe to send it elsewhere.
    """


class ConnectionBroken(UpstreamError):
    """The connection closed or broke before the whole answer arrived.

    Also raised for an answer that cannot be parsed, is too large, or was closed by the
    caller. `stale` is True when the connection came from the pool and no byte of the
    answer arrived: the worker closed an idle keep-alive connection, the request was most
    likely never processed, and it is safe to resend it at once. `received_any` tells
    whether any byte of the answer arrived (if so, resending would repeat a processed
    request).
    """

    def __init__(self, message: str, *, stale: bool, received_any: bool) -> None:
        super().__init__(message)
        self.stale = stale
        self.received_any = received_any


class Sink(typing.Protocol):
    """Where `UpstreamConnection.pipe` writes decoded body bytes (e.g. a client transport)."""

    def write(self, data: bytes) -> None: ...


class FramingSink(Sink, typing.Protocol):
    """A sink that sends chunked framing itself: a read that holds whole chunks of a
    chunked answer and nothing else is handed over as it came, frames and all, to
    `write_frame` (no decoding, no re-encoding: a streamed token's usual path)."""

    def write_frame(self, frame: bytes) -> None: ...


class _Malformed(Exception):
    """The answer breaks HTTP/1.1: the connection is dropped."""


def encode_request(
    method: str, path: str, host: str, headers: Iterable[tuple[str, str]], body: bytes
) -> bytes:
    """One HTTP/1.1 request as bytes: request line, Host, `headers`, Content-Length, body.

    Host, Content-Length and Transfer-Encoding among `headers` are dropped (this function
    writes the framing). A CR or LF in any part raises ValueError (header injection), as
    does a character outside Latin-1.
    """
    return RequestHead(method, path, host).encode(headers, body)


# Headers the request's framing writes itself (see `encode_request`).
_FRAMING_HEADERS = frozenset({"host", "content-length", "transfer-encoding"})


class RequestHead:
    """The request line and Host header of one method, path and host, checked once:
    `encode(headers, body)` is `encode_request(method, path, host, headers, body)` for the
    price of the headers alone (the proxy keeps one per worker and path)."""

    __slots__ = ("_line",)

    def __init__(self, method: str, path: str, host: str) -> None:
        line = f"{method} {path} HTTP/1.1\r\nHost: {host}\r\n"
        if line.count("\r") != 2 or line.count("\n") != 2:
            raise ValueError(f"CR or LF inside the request line or a header: {line!r}")
        self._line = line

    def encode(self, headers: Iterable[tuple[str, str]], body: bytes) -> bytes:
        """The request with `headers` (framing headers dropped) and `body`; ValueError for
        a CR or LF in a header or a character outside Latin-1."""
        lines = [f"{name}: {value}\r\n" for name, value in headers
                 if name.lower() not in _FRAMING_HEADERS]
        return self._encode("".join(lines), len(lines), body)

    def encode_lower(self, headers: Mapping[str, str], body: bytes) -> bytes:
        """`encode(headers.items(), body)` for headers whose names are all lower-case,
        joined without a Python loop (the proxy's own upstream headers)."""
        if not _FRAMING_HEADERS.isdisjoint(headers):
            return self.encode(headers.items(), body)
        block = "\r\n".join(map(": ".join, headers.items()))
        if block:
            block += "\r\n"
        return self._encode(block, len(headers), body)

    def _encode(self, block: str, lines: int, body: bytes) -> bytes:
        head = f"{self._line}{block}Content-Length: {len(body)}\r\n\r\n"
        if block.count("\r") != lines or block.count("\n") != lines:
            raise ValueError(f"CR or LF inside the request line or a header: {head!r}")
        return head.encode("latin-1") + body


# The status lines of HTTP/1.1 answers with their usual reason phrases, parsed: most
# answers' status line is one of these.
_STATUS_LINES = {f"HTTP/1.1 {status.value} {status.phrase}": (status.value, True)
                 for status in HTTPStatus if status.value >= 100}


def _parse_head(head: bytes) -> tuple[int, bool, dict[str, str]]:
    """(status, HTTP/1.1?, headers) of a response head without its final CRLF CRLF."""
    text = head.decode("latin-1")  # one decode, then string operations (cheaper per line)
    lines = text.split("\r\n")
    if text.count("\n") != len(lines) - 1 or text.count("\r") != len(lines) - 1:
        raise _Malformed("a bare CR or LF in the head")
    line = lines[0]
    known = _STATUS_LINES.get(line)  # "HTTP/1.1 200 OK" and the like: checked already
    if known is not None:
        status, http_11 = known
    elif (
        len(line) < 12
        or not line.startswith("HTTP/1.")
        or line[7] not in "01"
        or line[8] != " "
        or not line[9:12].isdigit()
        or not line[9:12].isascii()
        or (len(line) > 12 and line[12] != " ")
    ):
        raise _Malformed(f"status line {line[:100]!r}")
    else:
        status = int(line[9:12])
        http_11 = line[7] == "1"
        if status < 100:
            raise _Malformed(f"status {status}")
    headers: dict[str, str] = {}
    known_lines = _HEADER_LINES
    for line in lines[1:]:
        field = known_lines.get(line)
        if field is None:
            field = _header_field(line)
        key, value = field
        previous = headers.get(key)
        headers[key] = value if previous is None else f"{previous}, {value}"
    return status, http_11, headers


# Header lines seen before, parsed (a worker's answers repeat most of theirs: Server,
# Content-Type, the Date of this second...). Bounded, here and in the front's table of
# request lines (`remember_line`): at most 4,096 lines of at most 256 characters (~1 MB).
# Lines that set cookies are not kept.
_HEADER_LINES: dict[str, tuple[str, str]] = {}
MAX_KNOWN_HEADER_LINES = 4096
MAX_KNOWN_LINE_CHARS = 256
# Headers whose value is new in every message (request ids, trace context): a line of
# theirs is never seen twice, so keeping it would only fill the table. `Date` is kept:
# its line repeats for a whole second, and parsing it again would cost every answer.
UNIQUE_VALUE_HEADERS = frozenset({"x-request-id", "request-id", "x-correlation-id",
                                  "traceparent", "tracestate", "idempotency-key"})
_NOT_KEPT = UNIQUE_VALUE_HEADERS | {"set-cookie"}


def remember_line(known: dict[str, tuple[str, str]], line: str, field: tuple[str, str]) -> None:
    """Keep `field`, parsed from `line`, in `known` (a table of header lines seen before)
    unless the line is longer than MAX_KNOWN_LINE_CHARS. A full table is emptied first and
    refills with the lines in use: frozen full, as it once was, the lines seen since (the
    Date of each new second, after 68 minutes of them) would be parsed again forever."""
    if len(line) <= MAX_KNOWN_LINE_CHARS:
        if len(known) >= MAX_KNOWN_HEADER_LINES:
            known.clear()
        known[line] = field


def _header_field(line: str) -> tuple[str, str]:
    """(lower-case name, value) of a response header line; _Malformed if it is not one."""
    name, colon, value = line.partition(":")
    if not colon or not name or " " in name or "\t" in name:
        raise _Malformed(f"header line {line[:100]!r}")
    field = (name.lower(), value.strip(" \t"))
    if field[0] not in _NOT_KEPT:
        remember_line(_HEADER_LINES, line, field)
    return field


def _content_length(value: str) -> int:
    """Content-Length's value; a list of equal values (a repeated header) is allowed."""
    if value.isdigit() and value.isascii() and len(value) <= 18:
        return int(value)  # the usual single value
    first, *others = (part.strip() for part in value.split(","))
    if not first.isdigit() or not first.isascii() or len(first) > 18:
        raise _Malformed(f"Content-Length {value[:40]!r}")
    if any(other != first for other in others):
        raise _Malformed(f"conflicting Content-Length {value[:40]!r}")
    return int(first)


def _bare_size(data: bytes, pos: int) -> tuple[int, int]:
    """The usual chunk-size line at `pos`: 1-15 hex digits and CRLF. Returns the size and
    where the CRLF is, or (-1, -1) for anything else (extensions, a line not all here...),
    which `_chunk_size` then reads. A loop over bytes rather than `find`, `strip` and
    `int(..., 16)`: in the compiled build it is a few instructions per digit, where each
    of those calls costs hundreds (one per streamed token)."""
    end = len(data)
    limit = min(end, pos + 15)
    size = 0
    i = pos
    while i < limit:
        value = _HEX_VALUES[data[i]]
        if value < 0:
            break
        size = size * 16 + value
        i += 1
    if i == pos or i + 1 >= end or data[i] != 13 or data[i + 1] != 10:
        return -1, -1
    return size, i


def _chunk_size(line: bytes) -> int:
    """The size on a chunk-size line (hex digits, then maybe `;extensions`, ignored)."""
    semicolon = line.find(b";")
    digits = (line if semicolon < 0 else line[:semicolon]).strip(b" \t")
    if not digits or len(digits) > 15 or digits.strip(_HEX_DIGITS):
        raise _Malformed(f"chunk size line {line[:40]!r}")
    return int(digits, 16)


def _has_token(value: str, token: str) -> bool:
    return any(part.strip().lower() == token for part in value.split(","))


class UpstreamConnection(asyncio.Protocol):
    """One keep-alive connection to a worker, carrying one request at a time.

    Obtained from `UpstreamPool.send` with the request already written. Read the head
    (`head`), then the body (`read_some`, `read_all` or `pipe`), then `release` it (back to
    the pool) or `close` it (abort). After `release` the object belongs to the pool again:
    do not use it.
    """

    __slots__ = (
        "_body",
        "_body_bytes",
        "_buffer_paused",
        "_caller_paused",
        "_closed",
        "_complete",
        "_error",
        "_head_buffer",
        "_head_ready",
        "_idle_since",
        "_keep_alive",
        "_key",
        "_left",
        "_loop",
        "_no_body",
        "_parked",
        "_pending",
        "_pipe_future",
        "_pool",
        "_reading_paused",
        "_received_any",
        "_released",
        "_reusable",
        "_reused",
        "_sink",
        "_state",
        "_time",
        "_transport",
        "_waiter",
        "_write_frame",
        "headers",
        "reads",
        "status",
    )

    status: int
    headers: dict[str, str]
    reads: int  # reads from the socket so far: a stream's idle watchdog compares them

    def __init__(self, pool: UpstreamPool, key: tuple[str, int]) -> None:
        # Kept: `asyncio.get_running_loop()` costs a getpid() system call on every call
        # (CPython 3.11 checks for a fork), twice per request where it was called.
        self._loop = loop = asyncio.get_running_loop()
        self._pool = pool
        self._key = key
        self._time = loop.time
        self._transport: asyncio.Transport | None = None
        self._closed = False  # the transport is gone (connection_lost) or aborted by us
        self._parked = False  # idle in the pool
        self._idle_since = 0.0
        self._reading_paused = False
        self._head_buffer = bytearray()
        self._waiter: asyncio.Future[None] | None = None
        self.reads = 0
        self._reset(reused=False)
        self._state = _IDLE
        self._released = True

    def _reset(self, *, reused: bool) -> None:
        """Forget the previous answer: a new request is about to be written."""
        self.status = 0
        self.headers = {}
        self._state = _HEAD
        self._left = 0
        self._pending = b""  # an incomplete chunk-size or trailer line
        self._head_buffer.clear()
        self._head_ready = False
        self._complete = False
        self._error: str | None = None  # why the answer broke
        self._no_body = False  # a HEAD request: the answer has no body whatever it says
        self._keep_alive = False  # the answer allows reuse (HTTP/1.1, no Connection: close)
        self._reusable = True  # nothing we saw forbids reuse (cancelled, extra bytes, ...)
        self._reused = reused
        self._received_any = False
        self._released = False
        self._body: list[bytes] = []  # decoded body bytes not yet read
        self._body_bytes = 0
        self._buffer_paused = False
        self._caller_paused = False
        self._sink: Sink | None = None
        self._write_frame: typing.Callable[[bytes], None] | None = None
        self._pipe_future: asyncio.Future[None] | None = None

    # -- the caller's side --

    @property
    def complete(self) -> bool:
        """The whole answer has arrived (its body may still wait in the buffer)."""
        return self._complete

    @property
    def reading(self) -> bool:
        """The router is asking the worker for data now: a reader waits or a sink is
        piped, and reading is not paused (by a slow sink or a full buffer). Only while
        this holds can silence be the worker's: a stream's idle watchdog counts nothing
        else, so a client that stops reading never makes its worker look idle."""
        return not self._reading_paused and (self._sink is not None or self._waiter is not None)

    async def head(self) -> tuple[int, dict[str, str]]:
        """Wait for the status line and headers (1xx interim answers are skipped).

        Header names are lower-case; a repeated header's values are joined with ", ".
        Raises ConnectionBroken if the connection breaks first or the head is malformed.
        """
        while not self._head_ready:
            if self._error is not None:
                raise self._broken()
            waiter = self._waiter = self._loop.create_future()  # see `_wake`
            try:
                await waiter
            except asyncio.CancelledError:
                self._reusable = False  # the answer is left unread
                raise
            finally:
                self._waiter = None
        return self.status, self.headers

    async def read_some(self) -> bytes:
        """The decoded body bytes available now, waiting for some if there are none.

        b"" when the body is complete. Bytes that arrived before the connection broke are
        returned first; the next call raises ConnectionBroken.
        """
        if self._sink is not None:
            raise RuntimeError("read_some() on a piped connection")
        while True:
            if self._body:
                return self._take_body()
            if self._complete:
                return b""
            if self._error is not None:
                raise self._broken()
            waiter = self._waiter = self._loop.create_future()  # as in `head`, inline:
            try:  # a nested coroutine per wait cost more than these lines
                await waiter
            except asyncio.CancelledError:
                self._reusable = False  # the answer is left half-read
                raise
            finally:
                self._waiter = None

    def whole_body(self) -> bytes | None:
        """The rest of the body, without waiting, when the whole answer has arrived (a
        small answer usually comes in the read that brought its head); else None, and
        `read_all` is the way. Saves such an answer the awaits of `read_all`."""
        if not self._complete or self._sink is not None:
            return None
        return self._take_body() if self._body else b""

    def _take_body(self) -> bytes:
        """The buffered body bytes, taken out (reading resumes if the buffer paused it)."""
        body = self._body
        data = body[0] if len(body) == 1 else b"".join(body)
        body.clear()
        self._body_bytes = 0
        if self._buffer_paused:
            self._buffer_paused = False
            self._set_reading()
        return data

    async def read_all(self, limit: int = 64 * 1024 * 1024) -> bytes:
        """The whole rest of the body. ConnectionBroken (and the connection closed) when it
        breaks or exceeds `limit` bytes."""
        pieces: list[bytes] = []
        size = 0
        while True:
            data = await self.read_some()
            if not data:
                return pieces[0] if len(pieces) == 1 else b"".join(pieces)
            size += len(data)
            if size > limit:
                self.close()
                raise ConnectionBroken(
                    f"{self._key[0]}:{self._key[1]}: the answer's body is larger than {limit} "
                    "bytes", stale=False, received_any=True)
            pieces.append(data)

    def pipe(self, sink: Sink) -> asyncio.Future[None]:
        """Hand every decoded body byte to `sink.write` from now on, from `data_received`.

        Bytes already buffered are written first, here. Each read from the socket makes one
        `sink.write` call. The future's result is None when the body is complete; its
        exception is ConnectionBroken if the connection breaks or is closed first, or the
        exception `sink.write` raised (the connection is then closed).
        """
        if self._sink is not None:
            raise RuntimeError("pipe() called twice")
        future: asyncio.Future[None] = self._loop.create_future()
        future.add_done_callback(self._pipe_done)
        self._pipe_future = future
        self._sink = sink
        self._write_frame = getattr(sink, "write_frame", None)
        if self._body:
            self._emit(self._take_body())
        if self._buffer_paused:
            self._buffer_paused = False
            self._set_reading()
        if not future.done():
            if self._complete:
                future.set_result(None)
            elif self._error is not None:
                future.set_exception(self._broken())
        return future

    def pause_reading(self) -> None:
        """Stop reading from the worker (the sink is slow) until `resume_reading`."""
        self._caller_paused = True
        self._set_reading()

    def resume_reading(self) -> None:
        """Read from the worker again after `pause_reading`."""
        self._caller_paused = False
        self._set_reading()

    def release(self) -> None:
        """Give the connection back to its pool, or close it if it cannot be reused.

        Reused only when the whole answer arrived, the connection is open, the worker
        spoke HTTP/1.1 without `Connection: close`, and no read was cancelled. Idempotent.
        """
        if self._released:
            return
        self._released = True
        if self._complete and self._keep_alive and self._reusable and not self._closed:
            self._pool._park(self)
        else:
            self.close()

    def close(self) -> None:
        """Abort the connection at once (a generating engine sees it and stops).

        A pending head/read/pipe fails with ConnectionBroken. Idempotent.
        """
        self._released = True
        self._reusable = False
        if not self._complete and self._state != _IDLE:
            self._break("closed by the caller")
        else:
            self._abort()
        if self._parked:
            self._pool._forget(self)

    # -- asyncio.Protocol --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        aborted = self._closed  # by us (`_abort`): the close is not the body's end
        self._closed = True
        self._pool._lost(self)
        if self._state == _UNTIL_CLOSE and exc is None and not aborted and self._error is None:
            self._finish()  # the body's end
        elif not self._complete and self._state != _IDLE:
            why = f": {exc}" if exc is not None else ""
            self._break(f"the upstream closed the connection before the answer was complete{why}")

    def eof_received(self) -> bool | None:
        return None  # close our side too; connection_lost follows

    def data_received(self, data: bytes) -> None:
        self.reads += 1  # cheaper than noting the time of every read
        state = self._state
        if state == _LENGTH:  # the common cases first, without the general parser
            left = self._left
            if len(data) < left:
                self._left = left - len(data)
                self._emit(data)
                return
            if len(data) == left:
                self._left = 0
                self._emit(data)
                self._finish()
                return
        elif state == _UNTIL_CLOSE:
            self._emit(data)
            return
        elif state == _CHUNK_SIZE and not self._pending and self._whole_chunks(data):
            return
        elif state == _IDLE:  # bytes nobody asked for: the connection is out of step
            self.close()
            return
        self._received_any = True
        try:
            if state == _HEAD and not self._head_buffer:
                # The usual small answer: its whole head and a Content-Length body in
                # one read, taken without the general parser.
                end_of_head = data.find(b"\r\n\r\n")
                if end_of_head >= 0:
                    self._on_head(data[:end_of_head])
                    data = data[end_of_head + 4 :]
                    if self._state == _LENGTH and len(data) == self._left:
                        self._left = 0
                        self._emit(data)
                        self._finish()
                        return
            pieces = self._parse(data)
        except _Malformed as exc:
            self._break(f"malformed answer from the upstream: {exc}")
            return
        if pieces:
            self._emit(pieces[0] if len(pieces) == 1 else b"".join(pieces))
        if self._state == _DONE and not self._complete:
            self._finish()

    # -- parsing --

    def _whole_chunks(self, data: bytes) -> bool:
        """The fast path for a read that is whole non-empty chunks and nothing else (a
        streamed token, or a few): pass them on and return True. False leaves the read
        to the general parser (a partial chunk, extensions, the last chunk...)."""
        end = len(data)
        size, eol = _bare_size(data, 0)
        if size > 0 and eol + size + 4 == end and data[end - 2] == 13 and data[end - 1] == 10:
            # exactly one whole chunk, a streamed token's usual read: no loop
            self._received_any = True
            if self._write_frame is None:
                self._emit(data[eol + 2 : -2])
                return True
            try:
                self._write_frame(data)
            except Exception as exc:
                self._sink_failed(exc)
            return True
        pos = 0
        payload_at = chunks = 0
        while pos < end:
            chunks += 1
            size, eol = _bare_size(data, pos)
            if size <= 0:
                return False  # the last chunk, extensions, or not a size at all
            payload_at = eol + 2
            pos = payload_at + size + 2
            if pos > end or data[pos - 2] != 13 or data[pos - 1] != 10:
                return False
        self._received_any = True
        write_frame = self._write_frame
        if write_frame is None:
            if chunks == 1:
                self._emit(data[payload_at:-2])
                return True
            return False  # several: the general parser decodes them
        try:
            write_frame(data)
        except Exception as exc:
            self._sink_failed(exc)
        return True

    def _parse(self, data: bytes) -> list[bytes]:
        """Advance through `data`; return the decoded body pieces it held."""
        pieces: list[bytes] = []
        if self._pending:
            data = self._pending + data
            self._pending = b""
        pos = 0
        end = len(data)
        while pos < end:
            state = self._state
            if state == _CHUNK_DATA:
                take = self._left if self._left < end - pos else end - pos
                pieces.append(data if take == end else data[pos : pos + take])
                pos += take
                self._left -= take
                if self._left == 0:
                    if end - pos >= 2:
                        if data[pos] != 13 or data[pos + 1] != 10:
                            raise _Malformed("no CRLF after chunk data")
                        pos += 2
                        self._state = _CHUNK_SIZE
                    else:
                        self._state = _CHUNK_CRLF
                        self._left = 2
            elif state == _CHUNK_SIZE:
                size, eol = _bare_size(data, pos)  # the usual bare size
                if size < 0:
                    eol = data.find(b"\r\n", pos)
                    if eol < 0:
                        self._keep_pending(data[pos:], _MAX_CHUNK_LINE_BYTES)
                        break
                    size = _chunk_size(data[pos:eol])
                pos = eol + 2
                self._state = _CHUNK_DATA if size else _TRAILERS
                self._left = size
            elif state == _CHUNK_CRLF:  # the CRLF after chunk data, split across reads
                if data[pos] != (13 if self._left == 2 else 10):
                    raise _Malformed("no CRLF after chunk data")
                pos += 1
                self._left -= 1
                if self._left == 0:
                    self._state = _CHUNK_SIZE
            elif state == _TRAILERS:
                eol = data.find(b"\r\n", pos)
                if eol < 0:
                    self._keep_pending(data[pos:], MAX_HEAD_BYTES - self._left)
                    break
                if eol == pos:
                    self._state = _DONE
                else:
                    self._left += eol - pos + 2
                    if self._left > MAX_HEAD_BYTES:
                        raise _Malformed("trailers too large")
                pos = eol + 2
            elif state == _LENGTH:
                take = min(self._left, end - pos)
                pieces.append(data if take == end else data[pos : pos + take])
                pos += take
                self._left -= take
                if self._left == 0:
                    self._state = _DONE
            elif state == _HEAD:
                pos = self._parse_head_bytes(data, pos)
            elif state == _UNTIL_CLOSE:
                pieces.append(data[pos:] if pos else data)
                pos = end
            else:  # bytes after the whole answer: the connection is out of step
                self._reusable = False
                break
        return pieces

    def _keep_pending(self, rest: bytes, limit: int) -> None:
        if len(rest) > limit:
            raise _Malformed("line too long")
        self._pending = rest

    def _parse_head_bytes(self, data: bytes, pos: int) -> int:
        """Collect the head; once whole, parse it. Returns where the rest of `data` starts."""
        buffer = self._head_buffer
        if not buffer:
            eoh = data.find(b"\r\n\r\n", pos)
            if eoh >= 0:
                self._on_head(data[pos:eoh])
                return eoh + 4
            search_from = 0
        else:
            search_from = len(buffer) - 3
        before = len(buffer)
        buffer += memoryview(data)[pos:]
        eoh = buffer.find(b"\r\n\r\n", max(search_from, 0))
        if eoh < 0:
            if len(buffer) > MAX_HEAD_BYTES:
                raise _Malformed(f"head larger than {MAX_HEAD_BYTES} bytes")
            return len(data)
        head = bytes(buffer[:eoh])
        buffer.clear()
        self._on_head(head)
        return pos + eoh + 4 - before

    def _on_head(self, head: bytes) -> None:
        if len(head) > MAX_HEAD_BYTES:
            raise _Malformed(f"head larger than {MAX_HEAD_BYTES} bytes")
        status, http_11, headers = _parse_head(head)
        if status < 200:
            if status == 101:
                raise _Malformed("101 Switching Protocols is not supported")
            return  # an interim answer: the real one follows
        connection = headers.get("connection")
        self._keep_alive = http_11 and (connection is None or not _has_token(connection, "close"))
        transfer_encoding = headers.get("transfer-encoding")
        content_length = headers.get("content-length")
        if self._no_body or status in (204, 304):
            self._state = _DONE
        elif transfer_encoding is not None:
            if transfer_encoding.rsplit(",", 1)[-1].strip().lower() == "chunked":
                self._state = _CHUNK_SIZE
            else:
                self._state = _UNTIL_CLOSE
                self._keep_alive = False
            if content_length is not None:  # RFC 9112 6.3: suspicious, do not reuse
                self._keep_alive = False
        elif content_length is not None:
            self._left = _content_length(content_length)
            self._state = _LENGTH if self._left else _DONE
        else:
            self._state = _UNTIL_CLOSE
            self._keep_alive = False
        self.status = status
        self.headers = headers
        self._head_ready = True
        self._wake()

    # -- delivery --

    def _emit(self, data: bytes) -> None:
        """Hand decoded body bytes to the sink, or buffer them for a reader."""
        sink = self._sink
        if sink is not None:
            try:
                sink.write(data)
            except Exception as exc:
                self._sink_failed(exc)
            return
        self._body.append(data)
        self._body_bytes += len(data)
        if self._body_bytes > MAX_BUFFER_BYTES and not self._buffer_paused:
            self._buffer_paused = True
            self._set_reading()
        self._wake()

    def _sink_failed(self, exc: Exception) -> None:
        self._sink = self._write_frame = None
        self._reusable = False
        if self._error is None and not self._complete:
            self._error = f"the sink failed: {exc!r}"  # the answer is cut short here
        self._abort()
        future = self._pipe_future
        if future is not None and not future.done():
            future.set_exception(exc)

    def _finish(self) -> None:
        self._state = _DONE
        self._complete = True
        self._wake()
        future = self._pipe_future
        if future is not None and not future.done():
            future.set_result(None)

    def _break(self, why: str) -> None:
        """The answer cannot complete: abort, and fail whoever waits."""
        self._reusable = False
        self._abort()
        if self._complete or self._error is not None:
            return
        self._error = why
        self._wake()
        future = self._pipe_future
        if future is not None and not future.done():
            future.set_exception(self._broken())

    def _broken(self) -> ConnectionBroken:
        received_any = self._received_any
        return ConnectionBroken(
            f"{self._key[0]}:{self._key[1]}: {self._error}",
            stale=self._reused and not received_any,
            received_any=received_any,
        )

    def _abort(self) -> None:
        transport = self._transport
        if transport is not None and not self._closed:
            self._closed = True
            transport.abort()

    def _pipe_done(self, future: asyncio.Future[None]) -> None:
        if future.cancelled():
            self._reusable = False
        else:
            future.exception()  # retrieved: a caller that closed need not await it

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _set_reading(self) -> None:
        transport = self._transport
        if transport is None or self._closed or transport.is_closing():
            return
        paused = self._buffer_paused or self._caller_paused
        if paused != self._reading_paused:
            self._reading_paused = paused
            if paused:
                transport.pause_reading()
            else:
                transport.resume_reading()

    # -- for the pool --

    def _begin(self, payload: bytes, *, reused: bool) -> None:
        """Write a request and expect its answer."""
        self._reset(reused=reused)
        self._no_body = payload.startswith(b"HEAD ")
        if self._closed or self._transport is None:
            self._error = "the connection closed before the request was sent"
            return
        self._transport.write(payload)

    def _park(self) -> None:
        """Idle in the pool from now."""
        self._state = _IDLE
        self._parked = True
        self._idle_since = self._time()
        self._caller_paused = self._buffer_paused = False
        if self._reading_paused:
            self._set_reading()  # a peer's close or stray bytes must be noticed while idle


class UpstreamPool:
    """Keep-alive connections to the workers, per (host, port), most recently used first.

    One per router process; `close` it at shutdown. No request is ever written on a
    connection whose previous answer was not completely read.
    """

    def __init__(
        self, *, connect_timeout_s: float, keepalive_s: float = 4.0, max_idle_per_host: int = 1024,
        local_host: str | None = None,
    ) -> None:
        """`connect_timeout_s` bounds a TCP connect; an idle connection is closed after
        `keepalive_s`; beyond `max_idle_per_host` idle ones per worker, the oldest is closed."""
        if connect_timeout_s <= 0 or keepalive_s <= 0 or max_idle_per_host < 0:
            raise ValueError("connect_timeout_s and keepalive_s must be > 0, "
                             "max_idle_per_host >= 0")
        self._connect_timeout_s = connect_timeout_s
        self._keepalive_s = keepalive_s
        self._max_idle_per_host = max_idle_per_host
        # Connections leave from this address (None: the system's choice). The bench's
        # test bed gives each region's router its own loopback source address.
        self._local_addr = (local_host, 0) if local_host else None
        self._idle: dict[tuple[str, int], collections.deque[UpstreamConnection]] = {}
        self._open: set[UpstreamConnection] = set()
        self._opened = 0
        self._reused = 0
        self._sweep: asyncio.TimerHandle | None = None
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The running loop, looked up once (`asyncio.get_running_loop()` makes a system
        call each time): the pool is used from one loop."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        return loop

    async def send(self, host: str, port: int, payload: bytes, *,
                   ssl: ssl_module.SSLContext | None = None) -> UpstreamConnection:
        """Write `payload` (see `encode_request`) to the worker; its answer is pending.

        Takes the most recently used idle connection that is open and idle for less than
        `keepalive_s`, else connects. Raises ConnectFailed when the connect fails or takes
        longer than `connect_timeout_s`; UpstreamError after `close`. A broken reused
        connection shows later, as ConnectionBroken(stale=True) from head() or a read.
        """
        connection = self.send_idle(host, port, payload)
        if connection is not None:
            return connection
        connection = await self._connect((host, port), ssl)
        connection._begin(payload, reused=False)
        return connection

    def send_idle(self, host: str, port: int, payload: bytes) -> UpstreamConnection | None:
        """`send` on an idle connection, without an await; None if there is none (then
        `send`). UpstreamError after `close`."""
        if self._closed:
            raise UpstreamError("the upstream pool is closed")
        connection = self._take_idle((host, port))
        if connection is not None:
            self._reused += 1
            connection._begin(payload, reused=True)
        return connection

    def stats(self) -> dict[str, int]:
        """Connections opened and reuses since the start, and idle connections now."""
        idle = sum(len(connections) for connections in self._idle.values())
        return {"opened": self._opened, "reused": self._reused, "idle": idle}

    async def close(self) -> None:
        """Abort every connection, idle or in use; `send` fails from now on."""
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for connection in list(self._open):
            connection.close()
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports report their loss

    async def _connect(self, key: tuple[str, int],
                       ssl: ssl_module.SSLContext | None) -> UpstreamConnection:
        host, port = key
        loop = asyncio.get_running_loop()
        factory = functools.partial(UpstreamConnection, self, key)
        connecting = loop.create_task(loop.create_connection(  # TLS handshake included
            factory, host, port, ssl=ssl, server_hostname=host if ssl else None,
            local_addr=self._local_addr))
        try:
            done, _ = await asyncio.wait((connecting,), timeout=self._connect_timeout_s)
            if not done:
                # After the host stalled this process, the loop runs expired timers before
                # it reads the sockets: a connect that completed meanwhile is not seen yet,
                # and would fail as a timeout (a healthy worker ejected). Look once more,
                # after the loop has polled.
                done, _ = await asyncio.wait((connecting,), timeout=CONNECT_GRACE_S)
            if not done:
                raise TimeoutError
            _, connection = connecting.result()
        except TimeoutError:
            connecting.cancel()
            raise ConnectFailed(
                f"connect to {host}:{port} timed out after {self._connect_timeout_s} s") from None
        except ConnectionRefusedError:
            raise ConnectFailed(f"connect to {host}:{port} refused") from None
        except OSError as exc:
            raise ConnectFailed(f"connect to {host}:{port} failed: {exc}") from exc
        except BaseException:  # we were cancelled: the connect must not go on alone
            if connecting.done() and not connecting.cancelled() and not connecting.exception():
                connecting.result()[0].close()  # made just now: nobody will use it
            connecting.cancel()
            raise
        self._opened += 1
        if self._closed:
            connection.close()
            raise UpstreamError("the upstream pool is closed")
        self._open.add(connection)
        return connection

    def _take_idle(self, key: tuple[str, int]) -> UpstreamConnection | None:
        idle = self._idle.get(key)
        while idle:
            connection = idle.pop()
            connection._parked = False
            if connection._idle_since + self._keepalive_s <= connection._time():
                connection.close()  # expired, and so are all the older ones below it
                while idle:
                    connection = idle.pop()
                    connection._parked = False
                    connection.close()
                return None
            transport = connection._transport
            if transport is not None and not transport.is_closing():
                return connection
            connection.close()
        return None

    def _park(self, connection: UpstreamConnection) -> None:
        if self._closed or self._max_idle_per_host == 0:
            connection.close()
            return
        idle = self._idle.get(connection._key)
        if idle is None:
            idle = self._idle[connection._key] = collections.deque()
        elif len(idle) >= self._max_idle_per_host:
            oldest = idle.popleft()
            oldest._parked = False
            oldest.close()
        connection._park()
        idle.append(connection)
        if self._sweep is None:
            loop = asyncio.get_running_loop()
            self._sweep = loop.call_at(connection._idle_since + self._keepalive_s, self._sweep_idle)

    def _sweep_idle(self) -> None:
        """Close the connections idle for `keepalive_s`; come back for the next one due."""
        self._sweep = None
        loop = asyncio.get_running_loop()
        expired_since = loop.time() + _SWEEP_SLACK_S - self._keepalive_s
        next_due = float("inf")
        for key in list(self._idle):
            idle = self._idle[key]
            while idle and idle[0]._idle_since <= expired_since:
                connection = idle.popleft()
                connection._parked = False
                connection.close()
            if idle:
                next_due = min(next_due, idle[0]._idle_since + self._keepalive_s)
            else:
                del self._idle[key]
        if next_due != float("inf"):
            self._sweep = loop.call_at(next_due, self._sweep_idle)

    def _forget(self, connection: UpstreamConnection) -> None:
        """An idle connection closed: out of the pool."""
        connection._parked = False
        idle = self._idle.get(connection._key)
        if idle is not None:
            with contextlib.suppress(ValueError):  # already taken out
                idle.remove(connection)

    def _lost(self, connection: UpstreamConnection) -> None:
        self._open.discard(connection)
        if connection._parked:
            self._forget(connection)
