"""router.batch.api.ClientReads: a read of a request's body is cut off only when no byte of
the body arrives for the idle bound, however long the read takes in all."""

from __future__ import annotations

import asyncio
import time
from unittest import mock

import pytest
from aiohttp import StreamReader

from router.batch.api import ClientReads, UploadStalled
from tests.conftest import within


def stream() -> StreamReader:
    return StreamReader(mock.Mock(_reading_paused=False), 2**16,
                        loop=asyncio.get_running_loop())


async def test_a_read_that_keeps_receiving_bytes_is_not_cut_off() -> None:
    content = stream()

    async def trickle() -> None:
        for _ in range(10):  # 0.5 s in all, a byte every 0.05 s
            await asyncio.sleep(0.05)
            content.feed_data(b"x")

    feeding = asyncio.create_task(trickle())
    reads = ClientReads(content, idle_s=0.2)
    assert await reads(content.readexactly(10)) == b"x" * 10
    await feeding


async def test_a_read_that_receives_nothing_is_cut_off_and_the_body_readable_after() -> None:
    content = stream()
    content.feed_data(b"ab")
    reads = ClientReads(content, idle_s=0.1)
    started = time.monotonic()
    with pytest.raises(UploadStalled):
        await reads(content.readexactly(5))
    assert 0.09 < time.monotonic() - started < 1
    content.feed_data(b"cdef")  # (the cut read waits no more: another may read)
    assert await within(content.readany(), 1)


async def test_what_the_read_raises_comes_through() -> None:
    content = stream()
    content.feed_eof()
    reads = ClientReads(content, idle_s=0.1)
    with pytest.raises(asyncio.IncompleteReadError):
        await reads(content.readexactly(3))
