"""Where the parser is in one answer, and the general parser of its bytes: the head, then
the body as its framing says (Content-Length, chunked with trailers, or until close).

The connection (`connection.UpstreamConnection.data_received`) takes the usual reads
without this parser (a read within a Content-Length body, whole chunks, and a small
answer's head and body in one read, whose head it hands to `on_head`); every other read
comes here (`feed`).
"""

from __future__ import annotations

from typing import Final

from router.proxy.upstream.chunks import MAX_CHUNK_LINE_BYTES, bare_size, chunk_size
from router.proxy.upstream.errors import MalformedAnswer
from router.proxy.upstream.response_head import (
    MAX_HEAD_BYTES,
    content_length,
    has_token,
    parse_head,
)

# Where the parser is in the answer. Final, here and for the limits: in the compiled build a
# Final constant is a number in the code, a plain module global a dict lookup at each use.
IDLE: Final = 0  # no request outstanding
HEAD: Final = 1  # the status line and headers
LENGTH: Final = 2  # a body of Content-Length bytes (left: bytes still to come)
CHUNK_SIZE: Final = 3  # a chunk-size line
CHUNK_DATA: Final = 4  # chunk data (left: bytes still to come)
CHUNK_CRLF: Final = 5  # the CRLF after chunk data (left: 2 or 1 bytes of it still to come)
TRAILERS: Final = 6  # trailer lines after the last chunk (left: trailer bytes so far)
UNTIL_CLOSE: Final = 7  # a body that ends when the connection closes
DONE: Final = 8  # the whole answer has arrived


class AnswerDecoder:
    """The parser's place in one answer, and what its head said.

    `state` and `left` are where it is (see the states above); `pending` is an incomplete
    chunk-size or trailer line held for the next read. Once `head_ready`, `status` and
    `headers` are the final head's (1xx interim answers are skipped) and `keep_alive` says
    whether the answer allows reuse (HTTP/1.1, no `Connection: close`, nothing after it).
    """

    __slots__ = ("head_buffer", "head_ready", "headers", "keep_alive", "left", "no_body",
                 "pending", "state", "status")

    def __init__(self) -> None:
        self.head_buffer = bytearray()
        self.state = IDLE
        self.left = 0
        self.pending = b""
        self.no_body = False
        self.keep_alive = False
        self.head_ready = False
        self.status = 0
        self.headers: dict[str, str] = {}

    def reset(self, *, no_body: bool) -> None:
        """Expect a new answer; `no_body`: it answers a HEAD request, so it has no body
        whatever it says."""
        self.state = HEAD
        self.left = 0
        self.pending = b""
        self.head_buffer.clear()
        self.no_body = no_body
        self.keep_alive = False
        self.head_ready = False

    def feed(self, data: bytes) -> list[bytes]:
        """Advance through `data` (the general parser: every state, any split of the
        answer across reads); return the decoded body pieces it held. MalformedAnswer if
        the answer breaks HTTP/1.1."""
        pieces: list[bytes] = []
        if self.pending:
            data = self.pending + data
            self.pending = b""
        pos = 0
        end = len(data)
        while pos < end:
            state = self.state
            if state == CHUNK_DATA:
                take = self.left if self.left < end - pos else end - pos
                pieces.append(data if take == end else data[pos : pos + take])
                pos += take
                self.left -= take
                if self.left == 0:
                    if end - pos >= 2:
                        if data[pos] != 13 or data[pos + 1] != 10:
                            raise MalformedAnswer("no CRLF after chunk data")
                        pos += 2
                        self.state = CHUNK_SIZE
                    else:
                        self.state = CHUNK_CRLF
                        self.left = 2
            elif state == CHUNK_SIZE:
                size, eol = bare_size(data, pos)  # the usual bare size
                if size < 0:
                    eol = data.find(b"\r\n", pos)
                    if eol < 0:
                        self._keep_pending(data[pos:], MAX_CHUNK_LINE_BYTES)
                        break
                    size = chunk_size(data[pos:eol])
                pos = eol + 2
                self.state = CHUNK_DATA if size else TRAILERS
                self.left = size
            elif state == CHUNK_CRLF:  # the CRLF after chunk data, split across reads
                if data[pos] != (13 if self.left == 2 else 10):
                    raise MalformedAnswer("no CRLF after chunk data")
                pos += 1
                self.left -= 1
                if self.left == 0:
                    self.state = CHUNK_SIZE
            elif state == TRAILERS:
                eol = data.find(b"\r\n", pos)
                if eol < 0:
                    self._keep_pending(data[pos:], MAX_HEAD_BYTES - self.left)
                    break
                if eol == pos:
                    self.state = DONE
                else:
                    self.left += eol - pos + 2
                    if self.left > MAX_HEAD_BYTES:
                        raise MalformedAnswer("trailers too large")
                pos = eol + 2
            elif state == LENGTH:
                take = min(self.left, end - pos)
                pieces.append(data if take == end else data[pos : pos + take])
                pos += take
                self.left -= take
                if self.left == 0:
                    self.state = DONE
            elif state == HEAD:
                pos = self._parse_head_bytes(data, pos)
            elif state == UNTIL_CLOSE:
                pieces.append(data[pos:] if pos else data)
                pos = end
            else:  # bytes after the whole answer: the connection is out of step
                self.keep_alive = False
                break
        return pieces

    def _keep_pending(self, rest: bytes, limit: int) -> None:
        if len(rest) > limit:
            raise MalformedAnswer("line too long")
        self.pending = rest

    def _parse_head_bytes(self, data: bytes, pos: int) -> int:
        """Collect the head; once whole, parse it. Returns where the rest of `data` starts."""
        buffer = self.head_buffer
        if not buffer:
            eoh = data.find(b"\r\n\r\n", pos)
            if eoh >= 0:
                self.on_head(data[pos:eoh])
                return eoh + 4
            search_from = 0
        else:
            search_from = len(buffer) - 3
        before = len(buffer)
        buffer += memoryview(data)[pos:]
        eoh = buffer.find(b"\r\n\r\n", max(search_from, 0))
        if eoh < 0:
            if len(buffer) > MAX_HEAD_BYTES:
                raise MalformedAnswer(f"head larger than {MAX_HEAD_BYTES} bytes")
            return len(data)
        head = bytes(buffer[:eoh])
        buffer.clear()
        self.on_head(head)
        return pos + eoh + 4 - before

    def on_head(self, head: bytes) -> None:
        """A whole head (without its final CRLF CRLF): an interim one is skipped; the final
        one is kept (`head_ready`) and sets the body's framing."""
        if len(head) > MAX_HEAD_BYTES:
            raise MalformedAnswer(f"head larger than {MAX_HEAD_BYTES} bytes")
        status, http_11, headers = parse_head(head)
        if status < 200:
            if status == 101:
                raise MalformedAnswer("101 Switching Protocols is not supported")
            return  # an interim answer: the real one follows
        connection = headers.get("connection")
        self.keep_alive = http_11 and (connection is None or not has_token(connection, "close"))
        transfer_encoding = headers.get("transfer-encoding")
        length = headers.get("content-length")
        if self.no_body or status in (204, 304):
            self.state = DONE
        elif transfer_encoding is not None:
            if transfer_encoding.rsplit(",", 1)[-1].strip().lower() == "chunked":
                self.state = CHUNK_SIZE
            else:
                self.state = UNTIL_CLOSE
                self.keep_alive = False
            if length is not None:  # RFC 9112 6.3: suspicious, do not reuse
                self.keep_alive = False
        elif length is not None:
            self.left = content_length(length)
            self.state = LENGTH if self.left else DONE
        else:
            self.state = UNTIL_CLOSE
            self.keep_alive = False
        self.status = status
        self.headers = headers
        self.head_ready = True
