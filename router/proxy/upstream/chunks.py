"""Chunk-size lines of a chunked body read, and the reads that are whole chunks found.

The usual chunk-size line (a bare size and CRLF) and the usual read of a stream (whole
chunks and nothing else) have fast paths here; everything else goes to the decoder's
general parser (`decoder.AnswerDecoder.feed`).
"""

from __future__ import annotations

from typing import Final

from router.proxy.upstream.errors import MalformedAnswer

MAX_CHUNK_LINE_BYTES: Final = 4096  # a chunk-size line with its extensions
_HEX_DIGITS: Final = b"0123456789abcdefABCDEF"
# Each byte's value as a hex digit, -1 for the others (`bare_size`).
_HEX_VALUES: Final = tuple(int(chr(byte), 16) if bytes([byte]) in _HEX_DIGITS else -1
                           for byte in range(256))


def bare_size(data: bytes, pos: int) -> tuple[int, int]:
    """The usual chunk-size line at `pos`: 1-15 hex digits and CRLF. Returns the size and
    where the CRLF is, or (-1, -1) for anything else (extensions, a line not all here...),
    which `chunk_size` then reads. A loop over bytes rather than `find`, `strip` and
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


def chunk_size(line: bytes) -> int:
    """The size on a chunk-size line (hex digits, then maybe `;extensions`, ignored)."""
    semicolon = line.find(b";")
    digits = (line if semicolon < 0 else line[:semicolon]).strip(b" \t")
    if not digits or len(digits) > 15 or digits.strip(_HEX_DIGITS):
        raise MalformedAnswer(f"chunk size line {line[:40]!r}")
    return int(digits, 16)


def whole_chunks(data: bytes) -> int:
    """Whether `data` is whole non-empty chunks and nothing else (a streamed token, or a
    few): -1 if not (a partial chunk, extensions, the last chunk...: the general parser's
    reads), 0 if it is several, and for exactly one chunk where its payload starts (it
    ends 2 bytes before the end of `data`)."""
    end = len(data)
    size, eol = bare_size(data, 0)
    if size > 0 and eol + size + 4 == end and data[end - 2] == 13 and data[end - 1] == 10:
        return eol + 2  # exactly one whole chunk, a streamed token's usual read: no loop
    pos = 0
    payload_at = chunks = 0
    while pos < end:
        chunks += 1
        size, eol = bare_size(data, pos)
        if size <= 0:
            return -1  # the last chunk, extensions, or not a size at all
        payload_at = eol + 2
        pos = payload_at + size + 2
        if pos > end or data[pos - 2] != 13 or data[pos - 1] != 10:
            return -1
    return payload_at if chunks == 1 else 0
