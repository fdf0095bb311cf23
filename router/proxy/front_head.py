"""The front's request heads: which requests it serves, and their headers parsed.

`parse_head` takes a request head (up to its blank line) and gives what the front needs
to serve it, or None for anything it does not serve: that connection then goes to
aiohttp (see `router.proxy.front`).
"""

from __future__ import annotations

from router.core.endpoints import KIND_BY_PATH
from router.proxy.upstream.response_head import UNIQUE_VALUE_HEADERS, remember_line

# More header lines than this go to aiohttp, which refuses them (its own limit, 128).
MAX_HEADERS = 128
# Headers that may appear once: a repeated one goes to aiohttp's stricter parser.
_SINGLE_HEADERS = frozenset({"content-length", "host", "authorization"})

# The request lines the front serves, and the path each asks for.
_REQUEST_LINES = {f"POST {path} HTTP/1.1": path for path in KIND_BY_PATH}
# Header lines seen before, parsed: (lower-case name, value). Clients repeat most of
# theirs request after request (Host, Content-Type, Accept, User-Agent, Content-Length of
# a common size), and a lookup costs a third of parsing one. Bounded as the answers'
# table is (router.proxy.upstream.response_head.remember_line: 1 MB at worst, whatever
# clients send); lines that carry credentials, or a value new in every request, are never kept.
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


def parse_head(head: bytes) -> tuple[str, dict[str, str], int, bool] | None:
    """(path, headers, body length, close) of a request the front serves; None for
    anything else (aiohttp takes it)."""
    text = head.decode("latin-1")
    lines = text.split("\r\n")
    breaks = len(lines) - 1
    if breaks > MAX_HEADERS:
        return None
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
    # aiohttp reads (and inflates: Content-Encoding) the bodies the front does not.
    if ("transfer-encoding" in headers or "expect" in headers or "upgrade" in headers
            or "content-encoding" in headers):
        return None
    raw_length = headers.get("content-length", "0")
    if not raw_length.isdigit() or not raw_length.isascii() or len(raw_length) > 12:
        return None
    close = "close" in headers.get("connection", "").lower()
    return path, headers, int(raw_length), close
