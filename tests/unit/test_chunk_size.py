"""The chunk-size fast path (`bare_size`) agrees with a plain reading of RFC 9112's
chunk-size line on every input: a bare size of 1-15 hex digits right before CRLF, or
nothing (the general parser's `chunk_size` then reads the line)."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from router.proxy.upstream.chunks import bare_size

_BARE = re.compile(rb"[0-9a-fA-F]{1,15}\r\n")


def _expected(data: bytes, pos: int) -> tuple[int, int]:
    match = _BARE.match(data, pos)
    if match is None:
        return -1, -1
    return int(data[pos : match.end() - 2], 16), match.end() - 2


_LINE_BYTES = st.sampled_from([b"0", b"7", b"a", b"F", b"\r", b"\n", b";", b" ", b"g", b"x"])


@given(st.lists(_LINE_BYTES, max_size=24).map(b"".join), st.integers(0, 3))
def test_the_fast_path_reads_exactly_the_bare_sizes(line: bytes, pos: int) -> None:
    data = b"zzz"[:pos] + line
    assert bare_size(data, pos) == _expected(data, pos)


def test_examples() -> None:
    assert bare_size(b"1f\r\n" + b"x" * 31 + b"\r\n", 0) == (31, 2)
    assert bare_size(b"..A\r\n", 2) == (10, 3)
    assert bare_size(b"0\r\n\r\n", 0) == (0, 1)  # the last chunk: size 0
    assert bare_size(b"f" * 15 + b"\r\n", 0) == (16**15 - 1, 15)
    assert bare_size(b"f" * 16 + b"\r\n", 0) == (-1, -1)  # too long for the fast path
    assert bare_size(b"5;ext=1\r\n", 0) == (-1, -1)  # extensions: the general parser
    assert bare_size(b"5 \r\n", 0) == (-1, -1)
    assert bare_size(b"5\r", 0) == (-1, -1)  # the line is not all here yet
    assert bare_size(b"\r\n", 0) == (-1, -1)
