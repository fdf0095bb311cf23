"""A minimal HTTP/1.1 keep-alive client for the load generator (an asyncio Protocol).

It sends pre-encoded requests and parses just enough of the answer to time it: the status,
the body framing (Content-Length, chunked, or until close), the arrival of the first body
byte (TTFT) and of the last (E2E), and whether a stream ended with `data: [DONE]`. Far
cheaper per chunk than a general client, so the load generator does not limit the run.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import cast

_DONE = b"data: [DONE]"


@dataclass(slots=True)
class Answer:
    """One response. Times are perf_counter seconds."""

    status: int
    sent_s: float
    first_byte_s: float
    done_s: float
    body_bytes: int
    events: int  # SSE events (blank-line separated) in the body
    saw_done: bool
    head: bytes
    body_head: bytes  # the first bytes of the body (for error reports)


class ConnectionClosed(Exception):
    """The server closed the connection before the answer was complete."""


class HttpConnection(asyncio.Protocol):
    """One connection; one request at a time (`request`)."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._waiter: asyncio.Future[Answer] | None = None
        self._buffer = bytearray()
        self.closed = False
        self._reset()

    def _reset(self) -> None:
        self._in_head = True
        self._status = 0
        self._head = b""
        self._length: int | None = None  # Content-Length left, None when chunked/close
        self._chunked = False
        self._chunk_left = -1  # -1: expecting a size line
        self._until_close = False
        self._sent_s = 0.0
        self._first_byte_s = 0.0
        self._body_bytes = 0
        self._events = 0
        self._tail = b""
        self._body_head = b""

    # -- asyncio.Protocol --
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            if self._until_close and not self._in_head:
                self._complete()
            else:
                waiter.set_exception(ConnectionClosed(str(exc) if exc else "closed"))

    def data_received(self, data: bytes) -> None:
        if self._waiter is None:
            return  # nothing asked for: ignore
        self._buffer += data
        try:
            self._parse()
        except (ValueError, IndexError) as exc:
            if not self._waiter.done():
                self._waiter.set_exception(ConnectionClosed(f"unparsable answer: {exc}"))
            if self._transport is not None:
                self._transport.close()

    # -- the client --
    async def request(self, payload: bytes) -> Answer:
        """Send one pre-encoded request and wait for its whole answer."""
        if self._transport is None or self.closed:
            raise ConnectionClosed("not connected")
        self._reset()
        self._waiter = asyncio.get_running_loop().create_future()
        self._sent_s = time.perf_counter()
        self._transport.write(payload)
        try:
            return await self._waiter
        finally:
            self._waiter = None

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    # -- parsing --
    def _body(self, data: bytes | bytearray) -> None:
        if not data:
            return
        if self._body_bytes == 0:
            self._first_byte_s = time.perf_counter()
            self._body_head = bytes(data[:300])
        self._body_bytes += len(data)
        self._events += data.count(b"\n\n")
        if data[0] == 10 and self._tail.endswith(b"\n"):  # a blank line split across reads
            self._events += 1
        self._tail = (self._tail + bytes(data[-32:]))[-32:]

    def _parse(self) -> None:
        buffer = self._buffer
        if self._in_head:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(buffer[:end])
            del buffer[: end + 4]
            self._in_head = False
            self._head = head
            self._status = int(head[9:12])
            lower = head.lower()
            at = lower.find(b"\r\ncontent-length:")
            if at >= 0:
                value_end = lower.find(b"\r\n", at + 2)
                self._length = int(lower[at + 17 : value_end if value_end >= 0 else None])
            elif b"\r\ntransfer-encoding: chunked" in lower:
                self._chunked = True
            else:
                self._until_close = True
        if self._length is not None:
            take = min(self._length, len(buffer))
            self._body(buffer[:take])
            del buffer[:take]
            self._length -= take
            if self._length == 0:
                self._complete()
            return
        if self._until_close:
            self._body(buffer)
            buffer.clear()
            return
        while True:  # chunked
            if self._chunk_left < 0:
                line_end = buffer.find(b"\r\n")
                if line_end < 0:
                    return
                size = int(bytes(buffer[:line_end]).split(b";")[0], 16)
                del buffer[: line_end + 2]
                if size == 0:
                    self._chunk_left = -2
                else:
                    self._chunk_left = size
            if self._chunk_left == -2:  # after the last chunk: (no) trailers, then CRLF
                if len(buffer) < 2:
                    return
                del buffer[:2]
                self._complete()
                return
            if len(buffer) < self._chunk_left + 2:
                if self._chunk_left and len(buffer) > 0:
                    take = min(len(buffer), self._chunk_left)
                    self._body(buffer[:take])
                    del buffer[:take]
                    self._chunk_left -= take  # 0: only the CRLF is missing
                return
            self._body(buffer[: self._chunk_left])
            del buffer[: self._chunk_left + 2]
            self._chunk_left = -1

    def _complete(self) -> None:
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        now = time.perf_counter()
        waiter.set_result(Answer(
            status=self._status, sent_s=self._sent_s,
            first_byte_s=self._first_byte_s or now, done_s=now,
            body_bytes=self._body_bytes, events=self._events, saw_done=_DONE in self._tail,
            head=self._head, body_head=self._body_head,
        ))


async def connect(host: str, port: int) -> HttpConnection:
    _, protocol = await asyncio.get_running_loop().create_connection(HttpConnection, host, port)
    return protocol


def encode_post(host: str, port: int, path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nAccept: */*\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body
