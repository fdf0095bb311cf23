"""The hot-path HTTP/1.1 client (router.proxy.upstream) against real loopback workers."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest
import uvloop

from router.proxy.upstream.connection import UpstreamConnection
from router.proxy.upstream.errors import ConnectFailed, ConnectionBroken
from router.proxy.upstream.pool import UpstreamPool
from router.proxy.upstream.request import RequestHead, encode_request
from tests.conftest import within

pytestmark = pytest.mark.timeout(10)

Reply = Callable[[asyncio.StreamWriter], Awaitable[bool]]  # True: keep the connection


def answer(data: bytes) -> Reply:
    """Write `data` at once and keep the connection."""
    async def reply(writer: asyncio.StreamWriter) -> bool:
        writer.write(data)
        await writer.drain()
        return True
    return reply


def trickle(data: bytes) -> Reply:
    """Write `data` one byte per read of the client (a few loop turns between bytes)."""
    async def reply(writer: asyncio.StreamWriter) -> bool:
        for at in range(len(data)):
            writer.write(data[at : at + 1])
            for _ in range(3):
                await asyncio.sleep(0)
        await writer.drain()
        return True
    return reply


async def hang_up(writer: asyncio.StreamWriter) -> bool:
    """Close without answering (an idle connection the worker timed out)."""
    writer.transport.abort()
    return False


def answer_and_close(data: bytes) -> Reply:
    async def reply(writer: asyncio.StreamWriter) -> bool:
        writer.write(data)
        await writer.drain()
        writer.close()
        return False
    return reply


def ok(body: bytes = b"ok", extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)


def chunked(*chunks: bytes, trailer: bytes = b"") -> bytes:
    framed = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for chunk in chunks)
    return b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + framed + b"0\r\n" + (
        trailer + b"\r\n")


class Worker:
    """A loopback HTTP server answering each request with the next scripted reply."""

    def __init__(self, replies: list[Reply]) -> None:
        self.replies = replies
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed_by_client = 0  # connections the client closed (EOF or reset)
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> Worker:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line[15:])
                self.requests.append(head + await reader.readexactly(length))
                if not self.replies or not await self.replies.pop(0)(writer):
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_by_client += 1
            writer.close()

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        for writer in self.writers:
            writer.transport.abort()


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[list[Reply]], Awaitable[Worker]]]:
    workers: list[Worker] = []

    async def start(replies: list[Reply]) -> Worker:
        workers.append(await Worker(replies).start())
        return workers[-1]

    yield start
    for worker in workers:
        await worker.stop()


@pytest.fixture
async def pool() -> AsyncIterator[UpstreamPool]:
    upstream = UpstreamPool(connect_timeout_s=1.0)
    yield upstream
    await upstream.close()


class Collect:
    """A sink that keeps each write."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(data)


def get(port: int, path: str = "/v1/models") -> bytes:
    return encode_request("GET", path, f"127.0.0.1:{port}", [], b"")


async def until(condition: Callable[[], bool]) -> None:
    """Poll `condition` for up to a second."""
    for _ in range(200):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the condition never held")


async def roundtrip(pool: UpstreamPool, worker: Worker) -> tuple[int, bytes]:
    connection = await pool.send("127.0.0.1", worker.port, get(worker.port))
    status, _ = await connection.head()
    body = await connection.read_all()
    connection.release()
    return status, body


def test_encode_request_frames_the_body_and_refuses_injection() -> None:
    payload = encode_request("POST", "/v1/completions", "w1:8000",
                             [("X-Id", "7"), ("content-length", "99"), ("Host", "x")], b"{}")
    assert payload == (b"POST /v1/completions HTTP/1.1\r\nHost: w1:8000\r\nX-Id: 7\r\n"
                       b"Content-Length: 2\r\n\r\n{}")
    with pytest.raises(ValueError, match="CR or LF"):
        encode_request("GET", "/", "w1", [("X", "a\r\nEvil: 1")], b"")


def test_a_request_head_encodes_as_encode_request_does() -> None:
    head = RequestHead("POST", "/v1/completions", "w1:8000")
    headers = [("X-Id", "7"), ("content-length", "99"), ("Host", "x")]
    assert head.encode(headers, b"{}") == encode_request("POST", "/v1/completions", "w1:8000",
                                                         headers, b"{}")
    assert head.encode([], b"") == b"POST /v1/completions HTTP/1.1\r\nHost: w1:8000\r\n" \
        b"Content-Length: 0\r\n\r\n"
    with pytest.raises(ValueError, match="CR or LF"):
        head.encode([("X", "a\r\nEvil: 1")], b"")
    with pytest.raises(ValueError, match="CR or LF"):
        RequestHead("POST", "/v1\r\nEvil: 1", "w1")
    with pytest.raises(ValueError):  # outside Latin-1
        head.encode([("X", "\u20ac")], b"")


def test_lower_case_headers_encode_as_their_items_do() -> None:
    head = RequestHead("POST", "/v1/completions", "w1:8000")
    for headers in ({}, {"x-id": "7"}, {"x-id": "7", "accept": "*/*", "authorization": "Bearer k"},
                    {"x-id": "7", "content-length": "99", "host": "x"}):
        assert head.encode_lower(headers, b"{}") == head.encode(headers.items(), b"{}")
    with pytest.raises(ValueError, match="CR or LF"):
        head.encode_lower({"x": "a\r\nevil: 1"}, b"")
    with pytest.raises(ValueError, match="CR or LF"):
        head.encode_lower({"x": "a\nevil: 1"}, b"")


async def test_the_whole_body_of_an_answer_that_has_arrived(
        serve: Callable[[list[Reply]], Awaitable[Worker]], pool: UpstreamPool) -> None:
    worker = await serve([answer(ok(b"hello")), trickle(chunked(b"data: a\n\n"))])
    connection = await pool.send("127.0.0.1", worker.port, get(worker.port))
    assert connection.whole_body() is None  # nothing has arrived yet
    await connection.head()
    await until(lambda: connection.complete)
    assert connection.whole_body() == b"hello"
    assert connection.whole_body() == b""  # taken
    connection.release()
    connection = await pool.send("127.0.0.1", worker.port, get(worker.port))
    await connection.head()
    assert connection.whole_body() is None  # a stream still arriving: read it
    assert await connection.read_all() == b"data: a\n\n"
    connection.release()


async def test_a_content_length_answer(serve: Callable[[list[Reply]], Awaitable[Worker]],
                                       pool: UpstreamPool) -> None:
    worker = await serve([answer(ok(b"hello", b"X-A: 1\r\nx-a: 2\r\nContent-Type: text/x\r\n"))])
    connection = await pool.send("127.0.0.1", worker.port, encode_request(
        "POST", "/v1/chat", "w", [("X-Id", "1")], b"{}"))
    status, headers = await connection.head()
    assert status == 200 and connection.status == 200
    assert headers["x-a"] == "1, 2" and headers["content-type"] == "text/x"
    assert await connection.read_all() == b"hello"
    assert connection.complete
    assert worker.requests[0].endswith(b"X-Id: 1\r\nContent-Length: 2\r\n\r\n{}")


@pytest.mark.parametrize("mode", ["pipe", "read_some"])
async def test_a_chunked_answer_split_at_every_byte(
        serve: Callable[[list[Reply]], Awaitable[Worker]], pool: UpstreamPool, mode: str) -> None:
    chunks = [b"data: a\n\n", b"x" * 17, b"data: [DONE]\n\n"]
    worker = await serve([trickle(chunked(*chunks, trailer=b"X-T: 1\r\n")), answer(ok())])
    connection = await pool.send("127.0.0.1", worker.port, get(worker.port))
    await connection.head()
    if mode == "pipe":
        sink = Collect()
        async with asyncio.timeout(2):
            await connection.pipe(sink)
        assert b"".join(sink.writes) == b"".join(chunks)
        assert len(sink.writes) == len(b"".join(chunks))  # really one byte per read
    else:
        pieces = []
        for _ in range(1000):
            piece = await connection.read_some()
            if not piece:
                break
            pieces.append(piece)
        assert b"".join(pieces) == b"".join(chunks)
    connection.release()
    assert await roundtrip(pool, worker) == (200, b"ok")  # the framing ended where it should
    assert worker.connections == 1


async def test_chunk_extensions_and_trailers_are_skipped(
        serve: Callable[[list[Reply]], Awaitable[Worker]], pool: UpstreamPool) -> None:
    answer_bytes = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
                    b"5;name=value;x\r\nhello\r\n6 \r\n world\r\n0;last\r\n"
                    b"X-Checksum: abc\r\nX-More: 1\r\n\r\n")
    worker = await serve([answer(answer_bytes), answer(ok())])
    assert await roundtrip(pool, worker) == (200, b"hello world")
    assert await roundtrip(pool, worker) == (200, b"ok")
    assert pool.stats()["reused"] == 1


async def test_a_body_until_close_is_read_whole_and_not_reused(
        serve: Callable[[list[Reply]], Awaitable[Worker]], pool: UpstreamPool) -> None:
    worker = await serve([answer_and_close(b"HTTP/1.1 200 OK\r\n\r\nuntil the end"),
                          answer(ok())])
    assert await roundtrip(pool, worker) == (200, b"until the end")
    assert await roundtrip(pool, worker) == (200, b"ok")
    assert pool.stats() == {"opened": 2, "reused": 0, "idle": 1, "warmed": 0}


async def test_a_body_until_close_aborted_by_the_caller_is_not_complete(
        serve: Callable[[list[Reply]], Awaitable[Worker]], pool: UpstreamPool) -> None:
    worker = await serve([answer(b"HTTP/1.1 200 OK\r\n\r\npart")])  # then silence
    connection = await pool.send("127.0.0.1", worker.port, get(worker.port))
    assert await connection.read_some() == b"part"
    connection.close()
    await until(lambda: worker.closed_by_client == 1)
    with pytest.raises(ConnectionBroken, match="closed by the caller"):
        await connection.read_some()
    assert not connection.complete


async def test_keep_alive_reuses_one_connection(
        serve: Callable[[list[Reply]], Awaitable[Worker]], pool: UpstreamPool) -> None:
    worker = await serve([answer(ok(b"%d" % n)) for n in range(3)])
    assert [await roundtrip(pool, worker) for _ in range(3)] == [
        (200, b"0"), (200, b"1"), (200, b"2")]
    assert pool.stats() == {"opened": 1, "reused": 2, "idle": 1, "warmed": 0}
    assert worker.connections == 1


async def test_a_connection_warmed_ahead_serves_the_next_request(
        serve: Callable[[list[Reply]], Awaitable[Worker]], pool: UpstreamPool) -> None:
    """A hedged copy's connection is opened ahead (`warm`): the request that comes takes
    it, even while it is still being opened, and no second one is opened."""
    worker = await serve([answer(ok(b"%d" % n)) for n in range(3)])
    pool.warm("127.0.0.1", worker.port)
    pool.warm("127.0.0.1", worker.port)  # one is being opened: not another
    assert await roundtrip(pool, worker) == (200, b"0")  # sent as it is being opened
    assert pool.stats() == {"opened": 1, "reused": 1, "idle": 1, "warmed": 1}
    pool.warm("127.0.0.1", worker.port)  # one is idle: nothing to do
    await asyncio.sleep(0.05)
    assert await roundtrip(pool, worker) == (200, b"1")
    assert pool.stats() == {"opened": 1, "reused": 2, "idle": 1, "warmed": 1}
    assert worker.connections == 1


async def test_a_warmed_connection_is_parked_and_one_that_fails_is_dropped(
        serve: Callable[[list[Reply]], Awaitable[Worker]]) -> None:
    pool = UpstreamPool(connect_timeout_s=1.0, keepalive_s=0.3)
    worker = await serve([answer(ok())])
    with socket.socket() as unused:  # a port nobody listens on: refused
        unused.bind(("127.0.0.1", 0))
        refused = unused.getsockname()[1]
    try:
        pool.warm("127.0.0.1", worker.port)
        pool.warm("127.0.0.1", refused)
        await until(lambda: worker.connections == 1 and pool.stats()["idle"] == 1)
        with pytest.raises(ConnectFailed, match="refused"):  # the request connects itself
            await pool.send("127.0.0.1", refused, get(refused))
        await until(lambda: pool.stats()["idle"] == 0)  # unused for keepalive_s: closed
        await until(lambda: worker.closed_by_client == 1)
        assert pool.stats()["warmed"] == 1
    finally:
        await pool.close()


@pytest.mark.parametrize("answer_bytes", [
    ok(b"x", b"Connection: keep-alive, close\r\n"),
    b"HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\nx",
    b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"1\r\nx\r\n0\r\n\r\n",
])
async def test_an_answer_that_forbids_reuse_closes_the_connection(
        serve: Callable[[list[Reply]], Awaitable[Worker]], pool: UpstreamPool,
        answer_bytes: bytes) -> None:
    worker = await serve([answer(answer_bytes), answer(ok())])
    assert await roundtrip(pool, worker) == (200, b"x")
    assert pool.stats()["idle"] == 0
    assert await roundtrip(pool, worker) == (200, b"ok")
    assert pool.stats()["opened"] == 2
    await until(lambda: worker.closed_by_client == 1)


async def test_a_reused_connection_the_worker_closed_is_stale(
        serve: Callable[[list[Reply]], Awaitable[Worker]], pool: UpstreamPool) -> None:
    worker = await serve([answer(ok()), hang_up, hang_up])
    assert await roundtrip(pool, worker) == (200, b"ok")
    connection = await pool.send("127.0.0.1", worker.port, get(worker.port))
    with pytest.raises(ConnectionBroken) as broken:
        await connection.head()
    assert broken.value.stale and not broken.value.received_any
    connection.close()
    fresh = await pool.send("127.0.0.1", worker.port, get(worker.port))  # a new connection
    with pytest.raises(ConnectionBroken) as broken:
        await fresh.head()
    assert not broken.value.stale  # a fresh connection: the request may have been processed
    assert pool.stats()["opened"] == 2


async def test_a_break_mid_body_says_bytes_arrived(
        serve: Callable[[list[Reply]], Awaitable[Worker]], pool: UpstreamPool) -> None:
    worker = await serve([answer(ok()), answer_and_close(ok(b"x" * 10)[:-4])])
    assert await roundtrip(pool, worker) == (200, b"ok")
    connection = await pool.send("127.0.0.1", worker.port, get(worker.port))
    await connection.head()
    assert await connection.read_some() == b"xxxxxx"  # what arrived comes first
    with pytest.raises(ConnectionBroken) as broken:
        await connection.read_some()
    assert broken.value.received_any and not broken.value.stale
    connection.release()  # incomplete: closed, not pooled
    assert pool.stats()["idle"] == 0


async def test_an_idle_connection_the_worker_closes_leaves_the_pool(
        serve: Callable[[list[Reply]], Awaitable[Worker]], pool: UpstreamPool) -> None:
    async def answer_then_close_soon(writer: asyncio.StreamWriter) -> bool:
        writer.write(ok())
        await asyncio.sleep(0.02)
        writer.close()
        return False

    worker = await serve([answer_then_close_soon, answer(ok(b"2"))])
    assert await roundtrip(pool, worker) == (200, b"ok")
    assert pool.stats()["idle"] == 1
    await until(lambda: pool.stats()["idle"] == 0)
    assert await roundtrip(pool, worker) == (200, b"2")
    assert pool.stats()["opened"] == 2


async def test_bytes_on_an_idle_connection_drop_it(
        serve: Callable[[list[Reply]], Awaitable[Worker]], pool: UpstreamPool) -> None:
    async def answer_then_babble(writer: asyncio.StreamWriter) -> bool:
        writer.write(ok())
        await asyncio.sleep(0.02)
        writer.write(b"HTTP/1.1 200 OK\r\n")
        return True

    worker = await serve([answer_then_babble, answer(ok(b"2"))])
    assert await roundtrip(pool, worker) == (200, b"ok")
    await until(lambda: pool.stats()["idle"] == 0)
    assert await roundtrip(pool, worker) == (200, b"2")
    assert pool.stats() == {"opened": 2, "reused": 0, "idle": 1, "warmed": 0}


async def test_bytes_after_the_answer_forbid_reuse(
        serve: Callable[[list[Reply]], Awaitable[Worker]], pool: UpstreamPool) -> None:
    worker = await serve([answer(ok() + b"HTTP/1.1 200 OK\r\n"), answer(ok(b"2"))])
    assert await roundtrip(pool, worker) == (200, b"ok")
    assert await roundtrip(pool, worker) == (200, b"2")
    assert pool.stats()["opened"] == 2


async def test_idle_connections_expire_after_keepalive(
        serve: Callable[[list[Reply]], Awaitable[Worker]]) -> None:
    pool = UpstreamPool(connect_timeout_s=1.0, keepalive_s=0.05)
    try:
        worker = await serve([answer(ok()), answer(ok(b"2"))])
        assert await roundtrip(pool, worker) == (200, b"ok")
        assert pool.stats()["idle"] == 1
        await until(lambda: worker.closed_by_client == 1)  # the timer closed it
        assert pool.stats()["idle"] == 0
        assert await roundtrip(pool, worker) == (200, b"2")
        assert pool.stats() == {"opened": 2, "reused": 0, "idle": 1, "warmed": 0}
    finally:
        await pool.close()


async def test_the_most_recent_idle_connection_is_reused_first(
        serve: Callable[[list[Reply]], Awaitable[Worker]], pool: UpstreamPool) -> None:
    worker = await serve([answer(ok(b"%d" % n)) for n in range(3)])
    first = await pool.send("127.0.0.1", worker.port, get(worker.port))
    second = await pool.send("127.0.0.1", worker.port, get(worker.port))
    for connection in (first, second):
        await connection.read_all()
    first.release()
    second.release()
    again = await pool.send("127.0.0.1", worker.port, get(worker.port))
    assert again is second
    await again.read_all()
    again.release()


async def test_connect_refused(pool: UpstreamPool) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # nobody listens once it is closed
    with pytest.raises(ConnectFailed, match="refused"):
        await pool.send("127.0.0.1", port, get(port))


@pytest.fixture
def full_backlog() -> Iterator[int]:
    """A port whose accept queue is full: the kernel drops further SYNs, connects hang."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(3):
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex(("127.0.0.1", port))
        fillers.append(filler)
    yield port
    for filler in fillers:
        filler.close()
    listener.close()


async def test_connect_timeout(full_backlog: int) -> None:
    pool = UpstreamPool(connect_timeout_s=0.1)
    started_s = asyncio.get_running_loop().time()
    with pytest.raises(ConnectFailed, match=r"timed out after 0\.1 s"):
        await pool.send("127.0.0.1", full_backlog, get(full_backlog))
    assert asyncio.get_running_loop().time() - started_s < 0.5
    await pool.close()


async def test_pipe_writes_to_the_sink_and_completes(
        serve: Callable[[list[Reply]], Awaitable[Worker]], pool: UpstreamPool) -> None:
    chunks = [b"data: %d\n\n" % n for n in range(32)]
    worker = await serve([answer(chunked(*chunks))])
    connection = await pool.send("127.0.0.1", worker.port, get(worker.port))
    await connection.head()
    sink = Collect()
    async with asyncio.timeout(1):
        await connection.pipe(sink)
    assert b"".join(sink.writes) == b"".join(chunks)
    assert connection.complete
    connection.release()
    assert pool.stats()["idle"] == 1


async def test_close_mid_pipe_fails_the_pipe(
        serve: Callable[[list[Reply]], Awaitable[Worker]], pool: UpstreamPool) -> None:
    worker = await serve([answer(chunked(b"first")[:-5])])  # then silence
    connection = await pool.send("127.0.0.1", worker.port, get(worker.port))
    await connection.head()
    sink = Collect()
    piped = connection.pipe(sink)
    await until(lambda: sink.writes == [b"first"])
    connection.close()  # the caller's idle watchdog
    with pytest.raises(ConnectionBroken, match="closed by the caller"):
        await piped
    await until(lambda: worker.closed_by_client == 1)


async def test_a_failing_sink_fails_the_pipe_and_closes(
        serve: Callable[[list[Reply]], Awaitable[Worker]], pool: UpstreamPool) -> None:
    class Gone:
        def write(self, data: bytes) -> None:
            raise ConnectionResetError("client gone")

    worker = await serve([answer(chunked(b"a", b"b"))])
    connection = await pool.send("127.0.0.1", worker.port, get(worker.port))
    await connection.head()
    with pytest.raises(ConnectionResetError, match="client gone"):
        async with asyncio.timeout(1):
            await connection.pipe(Gone())
    connection.release()
    assert pool.stats()["idle"] == 0


@pytest.mark.parametrize("answer_bytes", [
    b"HTTP/1.1 2x0 OK\r\n\r\n",
    b"HTTP/2 200 OK\r\n\r\n",
    b"SSH-2.0-OpenSSH\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nbad header\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 1, 2\r\n\r\nx",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x5\r\nhello\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhelloXX0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 70_000,  # and never ends
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n" + b"X: y\r\n" * 20_000,
], ids=["status", "version", "not-http", "header", "negative-length", "two-lengths",
        "chunk-size", "chunk-0x", "chunk-crlf", "head-too-large", "head-unterminated",
        "trailers-too-large"])
async def test_a_malformed_answer_breaks_the_connection(
        serve: Callable[[list[Reply]], Awaitable[Worker]], pool: UpstreamPool,
        answer_bytes: bytes) -> None:
    worker = await serve([answer(answer_bytes)])
    connection = await pool.send("127.0.0.1", worker.port, get(worker.port))
    with pytest.raises(ConnectionBroken, match="malformed answer") as broken:
        async with asyncio.timeout(1):
            await connection.head()
            await connection.read_all()
    assert broken.value.received_any
    connection.release()
    await until(lambda: worker.closed_by_client == 1)
    assert pool.stats()["idle"] == 0


async def test_interim_answers_are_skipped(
        serve: Callable[[list[Reply]], Awaitable[Worker]], pool: UpstreamPool) -> None:
    worker = await serve([
        answer(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: x\r\n\r\n"
               + ok(b"after")),
        answer(ok())])
    connection = await pool.send("127.0.0.1", worker.port, get(worker.port))
    assert await connection.head() == (200, {"content-length": "5"})
    assert await connection.read_all() == b"after"
    connection.release()
    assert await roundtrip(pool, worker) == (200, b"ok")
    assert worker.connections == 1


async def test_answers_without_a_body(
        serve: Callable[[list[Reply]], Awaitable[Worker]], pool: UpstreamPool) -> None:
    worker = await serve([
        answer(b"HTTP/1.1 204 No Content\r\n\r\n"),
        answer(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n"),  # to a HEAD request
        answer(ok())])
    assert await roundtrip(pool, worker) == (204, b"")
    connection = await pool.send("127.0.0.1", worker.port, encode_request(
        "HEAD", "/", "w", [], b""))
    assert (await connection.head())[0] == 200 and await connection.read_all() == b""
    connection.release()
    assert await roundtrip(pool, worker) == (200, b"ok")
    assert worker.connections == 1


async def test_read_all_enforces_its_limit(
        serve: Callable[[list[Reply]], Awaitable[Worker]], pool: UpstreamPool) -> None:
    worker = await serve([answer(ok(b"x" * 100))])
    connection = await pool.send("127.0.0.1", worker.port, get(worker.port))
    with pytest.raises(ConnectionBroken, match="larger than 10 bytes"):
        await connection.read_all(limit=10)
    connection.release()
    assert pool.stats()["idle"] == 0


async def test_a_slow_reader_pauses_the_worker(
        serve: Callable[[list[Reply]], Awaitable[Worker]], pool: UpstreamPool) -> None:
    body = bytes(range(256)) * (32 * 1024 * 1024 // 256)  # more than socket buffers hold
    worker = await serve([answer(ok(body)), answer(ok())])
    connection = await pool.send("127.0.0.1", worker.port, get(worker.port))
    await connection.head()
    writer = worker.writers[0]
    waiting = -1
    for _ in range(100):  # until the worker's unsent bytes stop shrinking
        await asyncio.sleep(0.01)
        if writer.transport.get_write_buffer_size() == waiting:
            break
        waiting = writer.transport.get_write_buffer_size()
    assert waiting > len(body) - 16 * 1024 * 1024  # we hold ~1 MiB, the kernel some more
    assert await connection.read_all() == body
    connection.release()
    assert await roundtrip(pool, worker) == (200, b"ok")


async def test_a_cancelled_read_keeps_the_connection_out_of_the_pool(
        serve: Callable[[list[Reply]], Awaitable[Worker]], pool: UpstreamPool) -> None:
    async def answer_late(writer: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(0.05)
        writer.write(ok())
        return True

    worker = await serve([answer_late])
    connection = await pool.send("127.0.0.1", worker.port, get(worker.port))
    waiting = asyncio.create_task(connection.head())
    await asyncio.sleep(0.01)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await asyncio.sleep(0.08)  # the answer arrives whole meanwhile
    connection.release()
    assert pool.stats()["idle"] == 0


async def test_close_fails_a_pending_head_and_pool_close_aborts_connections_in_use(
        serve: Callable[[list[Reply]], Awaitable[Worker]]) -> None:
    pool = UpstreamPool(connect_timeout_s=1.0)
    worker = await serve([])  # never answers
    connection = await pool.send("127.0.0.1", worker.port, get(worker.port))
    waiting = asyncio.create_task(connection.head())
    await asyncio.sleep(0.01)
    await pool.close()
    with pytest.raises(ConnectionBroken, match="closed by the caller"):
        await waiting
    connection.close()  # idempotent
    connection.release()


async def _uvloop_scenario() -> None:
    replies = [answer(ok()), trickle(chunked(b"ab", b"cd")), hang_up]
    worker = await Worker(replies).start()
    pool = UpstreamPool(connect_timeout_s=1.0)
    try:
        assert await roundtrip(pool, worker) == (200, b"ok")
        connection: UpstreamConnection = await pool.send("127.0.0.1", worker.port,
                                                         get(worker.port))
        await connection.head()
        sink = Collect()
        async with asyncio.timeout(1):
            await connection.pipe(sink)
        assert b"".join(sink.writes) == b"abcd"
        connection.release()
        connection = await pool.send("127.0.0.1", worker.port, get(worker.port))
        with pytest.raises(ConnectionBroken) as broken:
            await connection.head()
        assert broken.value.stale
        assert pool.stats() == {"opened": 1, "reused": 2, "idle": 0, "warmed": 0}
    finally:
        await pool.close()
        await worker.stop()


def test_the_same_on_uvloop() -> None:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(within(_uvloop_scenario(), 3))


def in_pieces(*pieces: bytes) -> Reply:
    """Write each piece in its own read of the client (a pause between them)."""
    async def reply(writer: asyncio.StreamWriter) -> bool:
        for piece in pieces:
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.01)
        return True
    return reply


class CollectFrames(Collect):
    """A sink that does its own chunked framing: whole chunks come to write_frame."""

    def __init__(self) -> None:
        super().__init__()
        self.frames: list[bytes] = []

    def write_frame(self, frame: bytes) -> None:
        self.frames.append(frame)


async def test_a_read_of_one_whole_chunk_reaches_a_framing_sink_as_it_came(
        serve: Callable[[list[Reply]], Awaitable[Worker]], pool: UpstreamPool) -> None:
    events = [b"data: %d\n\n" % n for n in range(5)]
    frames = [b"%x\r\n%s\r\n" % (len(event), event) for event in events]
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    # One chunk per read, then two whole chunks in one read: as they came. A chunk with
    # an extension, a chunk split across reads and the last chunk go through the
    # general parser and arrive decoded.
    worker = await serve([in_pieces(head, *frames[:3], frames[3] + frames[4],
                                    b"3;ext=1\r\nabc\r\n", b"4\r\nde", b"fg\r\n",
                                    b"0\r\n\r\n")])
    connection = await pool.send("127.0.0.1", worker.port, get(worker.port))
    await connection.head()
    sink = CollectFrames()
    async with asyncio.timeout(2):
        await connection.pipe(sink)
    assert sink.frames == [*frames[:3], frames[3] + frames[4]]
    assert sink.writes == [b"abc", b"de", b"fg"]
    connection.release()
    assert pool.stats()["idle"] == 1  # the answer was read to its end: reusable


async def test_connections_leave_from_the_local_host_given() -> None:
    peers: list[str] = []

    async def note(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peers.append(writer.get_extra_info("peername")[0])
        await reader.readuntil(b"\r\n\r\n")
        writer.write(ok())
        await writer.drain()

    server = await asyncio.start_server(note, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = UpstreamPool(connect_timeout_s=1.0, local_host="127.0.0.2")
    try:
        connection = await pool.send("127.0.0.1", port, get(port))
        assert (await connection.head())[0] == 200
        assert await connection.read_all() == b"ok"
        connection.release()
        assert peers == ["127.0.0.2"]  # the test bed tells regions apart by this
    finally:
        await pool.close()
        server.close()
