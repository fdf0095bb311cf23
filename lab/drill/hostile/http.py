"""A raw HTTP/1.1 client for the hostile drill: one request per connection, read at the
pace a client behaviour chooses.

The socket's receive buffer is made small (`SO_RCVBUF`, set before connecting so that
the window is scaled for it), its segments Ethernet-sized (`TCP_MAXSEG`), and the stream
reader holds little, so that a client that reads slowly or not at all holds the router
back as a slow mobile client does: what it does not take waits in the router's socket
and then in the router. (The router's kernel still grows that socket's send buffer to
hundreds of KB, so an answer smaller than that never makes the router pause its worker.)

`read_head` and `BodyDecoder` parse only what the drill checks: the status, the headers,
and the body's framing (Content-Length, chunked, or until close). `AnswerReader` says what
a decoded body holds: SSE events up to `data: [DONE]` and any error event, or the JSON
answer or error.
"""

from __future__ import annotations

import asyncio
import json
import socket
from dataclasses import dataclass, field
from typing import Any

RCVBUF_BYTES = 4096
# An Ethernet path's segment size, not loopback's 64 KB: Linux grows a connection's send
# buffer with its congestion window, counted in segments, so the router's socket to this
# client holds what it would on a real network (measured: ~0.75 MB instead of ~3.9 MB).
MSS_BYTES = 1460
READ_LIMIT_BYTES = 8192  # the stream reader stops reading the socket past 2x this
MAX_HEAD_BYTES = 64 * 1024
MAX_JSON_BYTES = 4 * 1024 * 1024
_MAX_CHUNK_LINE_BYTES = 4096


class MalformedAnswer(Exception):
    """The router's answer breaks HTTP/1.1 (a finding: the router must never send one)."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    host: str
    port: int


async def connect(endpoint: Endpoint, rcvbuf_bytes: int = RCVBUF_BYTES
                  ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A TCP connection with a small receive buffer (see the module doc)."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf_bytes)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, MSS_BYTES)
        sock.setblocking(False)
        await loop.sock_connect(sock, (endpoint.host, endpoint.port))
    except BaseException:
        sock.close()
        raise
    return await asyncio.open_connection(sock=sock, limit=READ_LIMIT_BYTES)


def post_head(endpoint: Endpoint, path: str, content_length: int) -> bytes:
    """The head of a JSON POST whose body of `content_length` bytes is sent after it."""
    return (f"POST {path} HTTP/1.1\r\nHost: {endpoint.host}:{endpoint.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {content_length}\r\n\r\n"
            ).encode()


def post_bytes(endpoint: Endpoint, path: str, body: bytes) -> bytes:
    """A JSON POST, as a client library sends it."""
    return post_head(endpoint, path, len(body)) + body


@dataclass(frozen=True, slots=True)
class Head:
    status: int
    headers: dict[str, str]  # names in lower case; a repeated header keeps its last value

    @property
    def content_length(self) -> int | None:
        raw = self.headers.get("content-length")
        if raw is None or "chunked" in self.headers.get("transfer-encoding", "").lower():
            return None
        try:
            return int(raw)
        except ValueError as exc:
            raise MalformedAnswer(f"Content-Length {raw!r}") from exc

    @property
    def chunked(self) -> bool:
        return "chunked" in self.headers.get("transfer-encoding", "").lower()


def parse_head(raw: bytes) -> Head:
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise MalformedAnswer(f"status line {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon:
            raise MalformedAnswer(f"header line {line[:80]!r}")
        headers[name.strip().lower()] = value.strip()
    return Head(int(parts[1]), headers)


async def read_head(reader: asyncio.StreamReader) -> tuple[Head, bytes]:
    """The answer's head, and the body bytes read with it. EOFError if the connection
    closed first; MalformedAnswer if the head is not HTTP or too large."""
    buffer = b""
    while b"\r\n\r\n" not in buffer:
        data = await reader.read(4096)
        if not data:
            raise EOFError(f"the connection closed after {len(buffer)} bytes of the head")
        buffer += data
        if len(buffer) > MAX_HEAD_BYTES and b"\r\n\r\n" not in buffer:
            raise MalformedAnswer(f"a head larger than {MAX_HEAD_BYTES} bytes")
    raw, _, rest = buffer.partition(b"\r\n\r\n")
    return parse_head(raw), rest


class BodyDecoder:
    """A response body decoded by its framing as bytes arrive: `feed` returns the body
    bytes among them; `done` once the framing says the body is complete (a body that runs
    until the connection closes never is: `until_close`). Bytes past the end are counted
    in `extra_bytes`."""

    def __init__(self, head: Head) -> None:
        self._chunked = head.chunked
        length = head.content_length
        self.until_close = not self._chunked and length is None
        self._left = length or 0
        self._pending = b""
        self._state = "size"  # chunked: size, data, crlf, trailer
        self.done = length == 0
        self.extra_bytes = 0

    def feed(self, data: bytes) -> bytes:
        if self.done:
            self.extra_bytes += len(data)
            return b""
        if self.until_close:
            return data
        if not self._chunked:
            body = data[:self._left]
            self._left -= len(body)
            self.extra_bytes += len(data) - len(body)
            self.done = self._left == 0
            return body
        self._pending += data
        return self._dechunk()

    def _dechunk(self) -> bytes:
        out: list[bytes] = []
        while not self.done:
            if self._state == "data":
                piece = self._pending[:self._left]
                out.append(piece)
                self._left -= len(piece)
                self._pending = self._pending[len(piece):]
                if self._left:
                    break
                self._state = "crlf"
            elif self._state == "crlf":
                if len(self._pending) < 2:
                    break
                if self._pending[:2] != b"\r\n":
                    raise MalformedAnswer("no CRLF after a chunk's data")
                self._pending = self._pending[2:]
                self._state = "size"
            else:
                end = self._pending.find(b"\r\n")
                if end < 0:
                    if len(self._pending) > _MAX_CHUNK_LINE_BYTES:
                        raise MalformedAnswer("a chunk-size line without an end")
                    break
                line, self._pending = self._pending[:end], self._pending[end + 2:]
                if self._state == "trailer":
                    self.done = not line
                    continue
                try:
                    self._left = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError as exc:
                    raise MalformedAnswer(f"chunk size {line[:40]!r}") from exc
                self._state = "data" if self._left else "trailer"
        if self.done:
            self.extra_bytes += len(self._pending)
        return b"".join(out)


# The HTTP status behind an OpenAI error's `type`, as the router writes them
# (router.core.errors; the 4xx types stand for several statuses, one is enough here);
# vLLM's errors carry the status itself as `code`. An unknown type counts as 500.
_STATUS_BY_TYPE = {"invalid_request_error": 400, "authentication_error": 401,
                   "permission_error": 403, "rate_limit_error": 429, "server_error": 500,
                   "upstream_error": 502, "service_unavailable_error": 503,
                   "upstream_timeout_error": 504}


@dataclass(slots=True)
class AnswerReader:
    """What a decoded body holds. A stream: its data events up to the first
    `data: [DONE]` (`events`, `done`) and the first error event; a JSON answer: whether
    it has `choices`, or its error."""

    stream: bool
    events: int = 0
    done: bool = False
    error: dict[str, Any] | None = None
    error_after_done: bool = False
    answer_ok: bool = False
    _buffer: bytearray = field(default_factory=bytearray)

    def add(self, data: bytes) -> None:
        if not self.stream:
            if len(self._buffer) + len(data) <= MAX_JSON_BYTES:
                self._buffer += data
            return
        self._buffer += data
        *complete, tail = bytes(self._buffer).split(b"\n\n")
        self._buffer = bytearray(tail)
        for event in complete:
            self._event(event)

    def _event(self, event: bytes) -> None:
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done = True
            elif b'"error"' in payload and (error := _error_of(payload)) is not None:
                if self.done:
                    self.error_after_done = True
                elif self.error is None:
                    self.error = error
            elif not self.done:
                self.events += 1

    def finish(self) -> None:
        """The body is complete: judge a JSON answer."""
        if self.stream:
            return
        try:
            answer = json.loads(bytes(self._buffer))
        except ValueError:
            return
        if isinstance(answer, dict):
            self.answer_ok = isinstance(answer.get("choices"), list)
            error = answer.get("error")
            if isinstance(error, dict):
                self.error = error

    @property
    def error_status(self) -> int | None:
        """The HTTP status an error stands for (None without one); for a stream's error
        event the only status there is, after the head's 200."""
        if self.error is None:
            return None
        code = self.error.get("code")
        if isinstance(code, int):
            return code
        return _STATUS_BY_TYPE.get(str(self.error.get("type")), 500)


def _error_of(payload: bytes) -> dict[str, Any] | None:
    try:
        document = json.loads(payload)
    except ValueError:
        return None
    error = document.get("error") if isinstance(document, dict) else None
    return error if isinstance(error, dict) else None
