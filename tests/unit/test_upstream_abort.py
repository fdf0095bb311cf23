"""A body that ends when the connection closes, aborted by us, is never complete.

A real loopback worker answers without Content-Length (the body runs until it closes);
the pipe's sink fails, so the client aborts the connection. That close is ours, not the
body's end: the pipe fails with the sink's error and the answer never reads as complete.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import uvloop

from router.proxy.upstream.pool import UpstreamPool
from router.proxy.upstream.request import encode_request
from tests.conftest import within

pytestmark = pytest.mark.timeout(10)

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n"


class UntilCloseWorker:
    """Answers one request with HEAD + b"first", then (once `go` is set) b"second" and
    closes; notes when the client closed first."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.client_closed = asyncio.Event()
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> UntilCloseWorker:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(HEAD + b"first")
            await writer.drain()
            await self.go.wait()
            writer.write(b"second")
            await writer.drain()
            writer.close()
            await reader.read()  # EOF or a reset: the client is gone
        except ConnectionError:
            pass
        self.client_closed.set()

    def stop(self) -> None:
        assert self._server is not None
        self._server.close()


class FailsOnWrite:
    """A sink whose `failing_write`-th write raises (the client went away)."""

    def __init__(self, failing_write: int) -> None:
        self.failing_write = failing_write
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(data)
        if len(self.writes) == self.failing_write:
            raise ConnectionResetError("the client went away")


@pytest.fixture
async def worker() -> AsyncIterator[UntilCloseWorker]:
    started = await UntilCloseWorker().start()
    yield started
    started.stop()


async def _pipe_into_failing_sink(worker: UntilCloseWorker, failing_write: int) -> None:
    pool = UpstreamPool(connect_timeout_s=1.0)
    try:
        request = encode_request("GET", "/", f"127.0.0.1:{worker.port}", [], b"")
        connection = await pool.send("127.0.0.1", worker.port, request)
        await connection.head()
        sink = FailsOnWrite(failing_write)
        piped = connection.pipe(sink)
        worker.go.set()  # "second", then the worker's close, while the pipe runs
        with pytest.raises(ConnectionResetError, match="went away"):
            async with asyncio.timeout(2):
                await piped
        async with asyncio.timeout(2):
            await worker.client_closed.wait()
        for _ in range(5):  # the transport's loss is reported on a later loop turn
            await asyncio.sleep(0)
        assert not connection.complete
        assert b"".join(sink.writes) in (b"first", b"firstsecond")
        connection.release()
        assert pool.stats()["idle"] == 0
    finally:
        await pool.close()


@pytest.mark.parametrize("failing_write", [1, 2], ids=["buffered-bytes", "later-read"])
async def test_a_failed_sink_on_a_body_until_close_is_not_complete(
        worker: UntilCloseWorker, failing_write: int) -> None:
    await _pipe_into_failing_sink(worker, failing_write)


def test_the_same_on_uvloop() -> None:
    async def scenario() -> None:
        started = await UntilCloseWorker().start()
        try:
            await _pipe_into_failing_sink(started, 2)
        finally:
            started.stop()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(within(scenario(), 5))
