"""A response's head parsed: the status line and headers, and the values that frame the
body (Content-Length, Connection tokens). Header lines seen before are looked up in a
bounded table instead of being parsed again."""

from __future__ import annotations

from http import HTTPStatus
from typing import Final

from router.proxy.upstream.errors import MalformedAnswer

MAX_HEAD_BYTES: Final = 64 * 1024  # the status line and headers (and, apart, a chunked trailer)

# The status lines of HTTP/1.1 answers with their usual reason phrases, parsed: most
# answers' status line is one of these.
_STATUS_LINES = {f"HTTP/1.1 {status.value} {status.phrase}": (status.value, True)
                 for status in HTTPStatus if status.value >= 100}

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


def parse_head(head: bytes) -> tuple[int, bool, dict[str, str]]:
    """(status, HTTP/1.1?, headers) of a response head without its final CRLF CRLF.

    Header names are lower-case; a repeated header's values are joined with ", ".
    MalformedAnswer if it is not a response head.
    """
    text = head.decode("latin-1")  # one decode, then string operations (cheaper per line)
    lines = text.split("\r\n")
    if text.count("\n") != len(lines) - 1 or text.count("\r") != len(lines) - 1:
        raise MalformedAnswer("a bare CR or LF in the head")
    known = _STATUS_LINES.get(lines[0])  # "HTTP/1.1 200 OK" and the like: checked already
    status, http_11 = known if known is not None else _status_line(lines[0])
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


def _status_line(line: str) -> tuple[int, bool]:
    """(status, HTTP/1.1?) of a status line other than the usual ones (`_STATUS_LINES`);
    MalformedAnswer if it is not one."""
    if (
        len(line) < 12
        or not line.startswith("HTTP/1.")
        or line[7] not in "01"
        or line[8] != " "
        or not line[9:12].isdigit()
        or not line[9:12].isascii()
        or (len(line) > 12 and line[12] != " ")
    ):
        raise MalformedAnswer(f"status line {line[:100]!r}")
    status = int(line[9:12])
    if status < 100:
        raise MalformedAnswer(f"status {status}")
    return status, line[7] == "1"


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
    """(lower-case name, value) of a response header line; MalformedAnswer if it is not one."""
    name, colon, value = line.partition(":")
    if not colon or not name or " " in name or "\t" in name:
        raise MalformedAnswer(f"header line {line[:100]!r}")
    field = (name.lower(), value.strip(" \t"))
    if field[0] not in _NOT_KEPT:
        remember_line(_HEADER_LINES, line, field)
    return field


def content_length(value: str) -> int:
    """Content-Length's value; a list of equal values (a repeated header) is allowed."""
    if value.isdigit() and value.isascii() and len(value) <= 18:
        return int(value)  # the usual single value
    first, *others = (part.strip() for part in value.split(","))
    if not first.isdigit() or not first.isascii() or len(first) > 18:
        raise MalformedAnswer(f"Content-Length {value[:40]!r}")
    if any(other != first for other in others):
        raise MalformedAnswer(f"conflicting Content-Length {value[:40]!r}")
    return int(first)


def has_token(value: str, token: str) -> bool:
    """Whether the comma-separated header `value` holds `token` (lower-case)."""
    return any(part.strip().lower() == token for part in value.split(","))
