"""A request to a worker as bytes: request line, Host, headers, Content-Length, body."""

from __future__ import annotations

from collections.abc import Iterable, Mapping


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
