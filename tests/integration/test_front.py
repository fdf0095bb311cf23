"""The router's own HTTP/1.1 front (router.proxy.front) on raw sockets: what it serves,
what it hands over to aiohttp, and how connections end.

`Server: globalpool` marks an answer the front wrote; aiohttp's answers name aiohttp.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from typing import cast

import aiohttp
import pytest
import uvloop
from aiohttp import web

from router.core.errors import ApiError
from router.proxy.exchange import AiohttpExchange, Exchange, Reply, error_reply
from router.proxy.front import TASK_NAME
from router.proxy.site import FrontSite
from router.proxy.upstream.pool import UpstreamPool
from router.proxy.upstream.request import encode_request
from tests.conftest import within
from tests.integration.test_proxy import CHAT, FleetFactory, fleet_factory

pytestmark = pytest.mark.integration

__all__ = ["fleet_factory"]  # the fixture, shared with test_proxy


def _post(path: str, body: bytes, *extra: str) -> bytes:
    head = [f"POST {path} HTTP/1.1", "Host: router", "Content-Type: application/json",
            f"Content-Length: {len(body)}", *extra]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def _chat(stream: bool = False, **changes: object) -> bytes:
    return json.dumps({**CHAT, "stream": stream, **changes}).encode()


class Answer:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    @property
    def server(self) -> str:
        return self.headers.get("server", "")


async def _read_answer(reader: asyncio.StreamReader, timeout_s: float = 10) -> Answer:
    """One HTTP/1.1 answer (Content-Length or chunked) off a raw connection."""
    async with asyncio.timeout(timeout_s):
        head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        for _ in range(100_000):
            size = int((await within(reader.readuntil(b"\r\n"), 10)).strip(), 16)
            async with asyncio.timeout(10):
                chunk = await reader.readexactly(size + 2)
            if size == 0:
                break
            body += chunk[:-2]
    else:
        async with asyncio.timeout(10):
            body = await reader.readexactly(int(headers["content-length"]))
    return Answer(status, headers, body)


async def _connect(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def test_keep_alive_and_pipelined_requests_are_served_by_the_front(
    fleet_factory: FleetFactory,
) -> None:
    fleet = await fleet_factory({"a": "us-east"})
    reader, writer = await _connect(fleet.router_url)
    try:
        for stream in (False, True, False):
            writer.write(_post("/v1/chat/completions", _chat(stream)))
            answer = await _read_answer(reader)
            assert answer.status == 200, answer.body
            assert answer.server == "globalpool"
            assert answer.headers["x-globalpool-worker"] == "a"
            if stream:
                assert answer.body.rstrip().endswith(b"data: [DONE]")
                assert answer.headers["content-type"].startswith("text/event-stream")
            else:
                assert json.loads(answer.body)["object"] == "chat.completion"
        # Three requests in one write: three answers, in order, on the same connection.
        writer.write(_post("/v1/chat/completions", _chat(max_tokens=1))
                     + _post("/v1/completions", json.dumps(
                         {"model": "m", "prompt": "hi", "max_tokens": 2}).encode())
                     + _post("/v1/chat/completions", b"{not json"))
        answers = [await _read_answer(reader) for _ in range(3)]
        assert [a.status for a in answers] == [200, 200, 400]
        assert json.loads(answers[1].body)["object"] == "text_completion"
        assert json.loads(answers[2].body)["error"]["type"] == "invalid_request_error"
        assert {a.server for a in answers} == {"globalpool"}
    finally:
        writer.close()
    # Five requests reached the worker (the sixth was bad JSON), one after another: on
    # one kept-alive upstream connection.
    async with aiohttp.ClientSession() as session, session.get(
            f"{fleet.router_url}/metrics") as response:
        metrics = await response.text()
    opened = _sample(metrics, "globalpool_upstream_connections_opened_total")
    reused = _sample(metrics, "globalpool_upstream_connections_reused_total")
    assert (opened, reused) == (1, 4)


def _sample(metrics: str, name: str) -> float:
    line = next(line for line in metrics.splitlines() if line.startswith(name + " "))
    return float(line.split(" ")[1])


async def test_other_requests_hand_the_connection_to_aiohttp(fleet_factory: FleetFactory) -> None:
    fleet = await fleet_factory({"a": "us-east"})
    reader, writer = await _connect(fleet.router_url)
    try:
        writer.write(_post("/v1/chat/completions", _chat()))
        first = await _read_answer(reader)
        assert (first.status, first.server) == (200, "globalpool")
        # A GET on the same connection: aiohttp answers it, and the connection's later
        # inference requests (same routes, same answers).
        writer.write(b"GET /health HTTP/1.1\r\nHost: router\r\n\r\n")
        health = await _read_answer(reader)
        assert health.status == 200 and json.loads(health.body)["status"] == "ok"
        assert "aiohttp" in health.server
        writer.write(_post("/v1/chat/completions", _chat(stream=True)))
        streamed = await _read_answer(reader)
        assert streamed.status == 200 and b"data: [DONE]" in streamed.body
        assert "aiohttp" in streamed.server
        assert streamed.headers["x-globalpool-worker"] == "a"
    finally:
        writer.close()


async def test_a_pipelined_request_for_aiohttp_waits_for_the_one_before_it(
    fleet_factory: FleetFactory,
) -> None:
    fleet = await fleet_factory({"a": "us-east"})
    reader, writer = await _connect(fleet.router_url)
    try:
        # A stream, then a GET in the same write: the front serves the stream, then hands
        # the connection over with the GET's bytes; answers come in order.
        writer.write(_post("/v1/chat/completions", _chat(stream=True))
                     + b"GET /health HTTP/1.1\r\nHost: router\r\n\r\n")
        streamed = await _read_answer(reader)
        assert (streamed.status, streamed.server) == (200, "globalpool")
        assert streamed.body.rstrip().endswith(b"data: [DONE]")
        health = await _read_answer(reader)
        assert health.status == 200 and "aiohttp" in health.server
        assert json.loads(health.body)["status"] == "ok"
    finally:
        writer.close()


@pytest.mark.parametrize("request_bytes", [
    # A chunked upload, which the front does not parse.
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(_chat()), _chat()),
    # HTTP/1.0.
    b"POST /v1/chat/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(_chat()), _chat()),
], ids=["chunked-upload", "http-1.0"])
async def test_requests_the_front_does_not_parse_are_served_by_aiohttp(
    fleet_factory: FleetFactory, request_bytes: bytes,
) -> None:
    fleet = await fleet_factory({"a": "us-east"})
    reader, writer = await _connect(fleet.router_url)
    try:
        writer.write(request_bytes)
        answer = await _read_answer(reader)
        assert answer.status == 200, answer.body
        assert "aiohttp" in answer.server
        assert json.loads(answer.body)["object"] == "chat.completion"
    finally:
        writer.close()


@pytest.mark.parametrize("head", [
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nX-Bad: a\nInjected: b\r\n"
    b"Content-Length: 2\r\n\r\n{}",  # a bare LF inside the head
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 2\r\n"
    b"Content-Length: 3\r\n\r\n{}",  # two lengths
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Length: -2\r\n\r\n{}",
], ids=["bare-lf", "two-lengths", "negative-length"])
async def test_malformed_heads_get_a_400_and_never_reach_a_worker(
    fleet_factory: FleetFactory, head: bytes,
) -> None:
    fleet = await fleet_factory({"a": "us-east"})
    reader, writer = await _connect(fleet.router_url)
    try:
        writer.write(head)
        async with asyncio.timeout(10):
            answer_head = await reader.readuntil(b"\r\n\r\n")
        assert answer_head.split(b" ")[1] == b"400"  # aiohttp answers it
        assert await fleet.running("a") == 0
    finally:
        writer.close()


async def test_a_body_in_pieces_is_waited_for_and_a_missing_one_times_out(
    fleet_factory: FleetFactory,
) -> None:
    fleet = await fleet_factory({"a": "us-east"}, client_timeouts={"body_s": 1.0})
    body = _chat()
    reader, writer = await _connect(fleet.router_url)
    try:
        request = _post("/v1/chat/completions", body)
        cut = len(request) - len(body) // 2
        writer.write(request[:cut])
        await asyncio.sleep(0.2)
        writer.write(request[cut:])
        answer = await _read_answer(reader)
        assert (answer.status, answer.server) == (200, "globalpool")
        # Promise a body and never send it: 408 after client_timeouts.body_s (1 s here),
        # then the connection closes.
        started = time.monotonic()
        writer.write(_post("/v1/chat/completions", b"")[:-4]
                     .replace(b"Content-Length: 0", b"Content-Length: 50") + b"\r\n\r\n{")
        late = await _read_answer(reader)
        assert late.status == 408
        assert json.loads(late.body)["error"]["message"].startswith("the request body did not")
        assert 0.9 < time.monotonic() - started < 5
        assert await within(reader.read(), 5) == b""  # closed
    finally:
        writer.close()


async def test_an_unread_body_closes_the_connection_after_the_refusal(
    fleet_factory: FleetFactory,
) -> None:
    fleet = await fleet_factory({"a": "us-east"})
    reader, writer = await _connect(fleet.router_url)
    try:
        # Larger than the 4 MiB default limit: refused before its body is read.
        head = _post("/v1/chat/completions", b"")
        writer.write(head.replace(b"Content-Length: 0", b"Content-Length: 99999999") + b"{")
        answer = await _read_answer(reader)
        assert answer.status == 413
        assert answer.headers.get("connection") == "close"
        assert await within(reader.read(), 5) == b""
    finally:
        writer.close()


async def test_a_client_that_leaves_mid_stream_stops_the_upstream(
    fleet_factory: FleetFactory,
) -> None:
    fleet = await fleet_factory({"a": "us-east"}, decode_step_ms=50.0)
    reader, writer = await _connect(fleet.router_url)
    writer.write(_post("/v1/chat/completions", _chat(stream=True, max_tokens=200)))
    async with asyncio.timeout(10):
        await reader.readuntil(b"\r\n\r\n")
    async with asyncio.timeout(10):
        await reader.readuntil(b"data: ")
    assert await fleet.running("a") == 1
    writer.close()
    deadline = time.monotonic() + 5
    while await fleet.running("a") != 0:
        assert time.monotonic() < deadline, "the worker kept generating for a gone client"
        await asyncio.sleep(0.05)


# The head of a worker's streamed answer, as the raw test workers write it.
_SSE_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
             b"Transfer-Encoding: chunked\r\n\r\n")
_Worker = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _relay_site(
    serve: _Worker,
) -> tuple[asyncio.Server, UpstreamPool, web.AppRunner, FrontSite]:
    """A raw worker answering with `serve`, and a front whose handler relays each
    request's stream from it (no router app: the front and the upstream pool alone)."""
    worker = await asyncio.start_server(serve, "127.0.0.1", 0)
    worker_port = worker.sockets[0].getsockname()[1]
    pool = UpstreamPool(connect_timeout_s=1.0)

    async def relay(exchange: Exchange) -> Reply:
        await exchange.read_body(5.0)
        upstream = await pool.send("127.0.0.1", worker_port, encode_request(
            "POST", "/", f"127.0.0.1:{worker_port}", (), b""))
        await upstream.head()
        first = await upstream.read_some()
        assert await exchange.relay({"Content-Type": "text/event-stream"}, first,
                                    upstream) is None
        await exchange.end_stream(b"")
        upstream.release()
        return Reply(200, streamed=True)

    runner = web.AppRunner(web.Application())
    await runner.setup()
    site = FrontSite(runner, "127.0.0.1", 0, handler=relay, header_timeout_s=5.0)
    await site.start()
    return worker, pool, runner, site


async def test_a_client_that_reads_slowly_pauses_the_upstream() -> None:
    """Flow control end to end: the client stops reading a big stream, the front's
    transport fills, the upstream connection stops reading, the worker's writes back up;
    then the client reads on and gets every byte."""
    chunk = b"data: " + b"x" * (64 * 1024 - 8) + b"\n\n"
    count = 512  # 32 MiB: more than the kernel's socket buffers hold on the way
    writers: list[asyncio.StreamWriter] = []

    async def blast(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        await reader.readuntil(b"\r\n\r\n")
        writer.write(_SSE_HEAD)
        for _ in range(count):
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    worker, pool, runner, site = await _relay_site(blast)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", site.port, limit=2**20)
        client = cast(asyncio.Transport, writer.transport)
        client.pause_reading()  # the client stops reading
        writer.write(_post("/v1/chat/completions", b"{}"))
        waiting = -1
        for _ in range(100):
            await asyncio.sleep(0.05)
            if writers and writers[0].transport.get_write_buffer_size() == waiting:
                break
            waiting = writers[0].transport.get_write_buffer_size() if writers else -1
        total = len(chunk) * count
        assert waiting > total - 16 * 1024 * 1024  # held back at the worker, not here
        client.resume_reading()
        answer = await _read_answer(reader, timeout_s=30)
        assert answer.status == 200 and len(answer.body) == total
        writer.close()
    finally:
        await runner.cleanup()
        await pool.close()
        worker.close()


async def test_an_idle_or_half_sent_head_is_closed_after_header_s(
    fleet_factory: FleetFactory,
) -> None:
    fleet = await fleet_factory({"a": "us-east"}, client_timeouts={"header_s": 0.5})
    reader, writer = await _connect(fleet.router_url)
    try:
        # A served request, then silence on the kept-alive connection: closed.
        writer.write(_post("/v1/chat/completions", _chat()))
        assert (await _read_answer(reader)).status == 200
        started = time.monotonic()
        assert await within(reader.read(), 5) == b""
        assert 0.4 < time.monotonic() - started < 3
    finally:
        writer.close()
    reader, writer = await _connect(fleet.router_url)
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\n")  # never finished
        assert await within(reader.read(), 5) == b""
    finally:
        writer.close()


async def test_header_s_counts_from_the_last_answer_on_a_busy_connection() -> None:
    """The head timer is one per connection, moved forward only when it fires early: a
    connection kept busy past header_s stays open, and closes header_s after its last
    answer."""

    async def ok(exchange: Exchange) -> Reply:
        await exchange.read_body(5.0)
        await asyncio.sleep(0.05)
        return Reply(200, {"Content-Type": "text/plain"}, b"ok")

    runner = web.AppRunner(web.Application())
    await runner.setup()
    site = FrontSite(runner, "127.0.0.1", 0, handler=ok, header_timeout_s=0.4)
    await site.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", site.port)
        started = time.monotonic()
        while time.monotonic() - started < 1.2:  # three header_s of requests, 0.3 s apart
            writer.write(_post("/v1/chat/completions", b"{}"))
            assert (await _read_answer(reader)).status == 200
            await asyncio.sleep(0.3)
        writer.write(_post("/v1/chat/completions", b"{}"))
        assert (await _read_answer(reader)).status == 200
        answered = time.monotonic()
        assert await within(reader.read(), 5) == b""
        assert 0.35 < time.monotonic() - answered < 2
        writer.close()
    finally:
        await runner.cleanup()


async def test_one_task_serves_a_connection_and_ends_with_it() -> None:
    """A connection's requests run one after another in one task, which ends when the
    connection is handed over to aiohttp or closed (none is left behind)."""

    async def ok(exchange: Exchange) -> Reply:
        await exchange.read_body(5.0)
        return Reply(200, {"Content-Type": "text/plain"}, b"ok")

    def front_tasks() -> list[asyncio.Task[object]]:
        return [task for task in asyncio.all_tasks() if not task.done()
                and task.get_name() == TASK_NAME]

    async def health(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = FrontSite(runner, "127.0.0.1", 0, handler=ok, header_timeout_s=5.0)
    await site.start()
    try:
        handed, handed_writer = await asyncio.open_connection("127.0.0.1", site.port)
        closed, closed_writer = await asyncio.open_connection("127.0.0.1", site.port)
        for reader, writer in ((handed, handed_writer), (closed, closed_writer)):
            for _ in range(3):
                writer.write(_post("/v1/chat/completions", b"{}"))
                assert (await _read_answer(reader)).body == b"ok"
        assert len(front_tasks()) == 2  # one per connection, idle between requests
        # Pipelined behind a request: handed over from the task itself.
        handed_writer.write(_post("/v1/chat/completions", b"{}")
                            + b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n")
        assert (await _read_answer(handed)).body == b"ok"
        assert (await _read_answer(handed)).body == b"ok"
        closed_writer.close()
        for _ in range(100):
            if not front_tasks():
                break
            await asyncio.sleep(0.01)
        assert front_tasks() == []
        handed_writer.write(b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n")  # still served
        assert (await _read_answer(handed)).status == 200
        handed_writer.close()
    finally:
        await runner.cleanup()


async def test_a_body_larger_than_the_read_ahead_is_read_whole(
    fleet_factory: FleetFactory,
) -> None:
    fleet = await fleet_factory({"a": "us-east"})
    big = _chat(messages=[{"role": "user", "content": "y" * (1024 * 1024)}], max_tokens=1)
    reader, writer = await _connect(fleet.router_url)
    try:
        request = _post("/v1/chat/completions", big)
        for at in range(0, len(request), 100_000):  # in pieces, as a real client's would
            writer.write(request[at : at + 100_000])
            await writer.drain()
        answer = await _read_answer(reader)
        # The worker got all of it: it counts the whole prompt (1 MiB / 4 characters per
        # token) and refuses it as longer than its context.
        assert (answer.status, answer.server) == (400, "globalpool")
        assert "your prompt contains 262144 input tokens" in json.loads(answer.body)["error"][
            "message"]
    finally:
        writer.close()


def _answer_across_a_stall(first: bytes, rest: bytes, *, header_timeout_s: float,
                           body_timeout_s: float) -> bytes:
    """What the router answers a client that sends `first`, then `rest` while the router's
    loop is stalled for 0.6 s inside an I/O callback: a stalled host, as the loop sees it.
    The router reads bodies within `body_timeout_s` (its own front, or aiohttp for what
    the front hands over) and answers 200 with the body, or the 408."""

    async def echo(exchange: Exchange) -> Reply:
        try:
            body = await exchange.read_body(body_timeout_s)
        except ApiError as exc:
            return error_reply(exc.status, exc.message)
        return Reply(200, {"Content-Type": "text/plain"}, body)

    async def echo_from_aiohttp(request: web.Request) -> web.Response:
        reply = await echo(AiohttpExchange(request))
        return web.Response(status=reply.status, body=reply.body, headers=reply.headers)

    class Staller(asyncio.Protocol):
        def data_received(self, data: bytes) -> None:
            time.sleep(0.6)

    answers: list[bytes] = []

    def client(port: int, first_sent: threading.Event, go: threading.Event) -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(first)
            first_sent.set()
            go.wait(5)
            time.sleep(0.1)  # inside the stall
            sock.sendall(rest)
            try:
                answers.append(sock.recv(65536))
            except OSError as exc:
                answers.append(repr(exc).encode())

    async def main() -> None:
        loop = asyncio.get_running_loop()
        app = web.Application()
        app.router.add_post("/v1/chat/completions", echo_from_aiohttp)
        runner = web.AppRunner(app)
        await runner.setup()
        site = FrontSite(runner, "127.0.0.1", 0, handler=echo, header_timeout_s=header_timeout_s)
        await site.start()
        staller = await loop.create_server(Staller, "127.0.0.1", 0)
        stall_port = staller.sockets[0].getsockname()[1]
        first_sent, go = threading.Event(), threading.Event()
        thread = threading.Thread(target=client, args=(site.port, first_sent, go))
        thread.start()
        try:
            await loop.run_in_executor(None, first_sent.wait, 5)
            await asyncio.sleep(0.05)  # the router has the connection: its timer runs
            _, poke = await asyncio.open_connection("127.0.0.1", stall_port)
            go.set()
            poke.write(b"x")  # the stall starts in an I/O callback of the next iteration
            for _ in range(100):
                await asyncio.sleep(0.02)
                if answers:
                    break
            poke.close()
        finally:
            await loop.run_in_executor(None, thread.join, 5)
            staller.close()
            await runner.cleanup()

    uvloop.run(main())
    assert answers, "no answer"
    return answers[0]


def test_a_head_that_arrived_while_the_host_stalled_is_served() -> None:
    """libuv runs due timers after the I/O callbacks of an iteration: when the process
    stalls inside one of those callbacks (this machine's host stalls processes for tens
    of seconds) past header_s, the head timer fires before the loop reads the head that
    arrived meanwhile. The front must look again before closing the connection."""
    answer = _answer_across_a_stall(b"", _post("/v1/chat/completions", b"{}"),
                                    header_timeout_s=0.3, body_timeout_s=5.0)
    assert answer.startswith(b"HTTP/1.1 200 "), answer


_CHUNKED_HEAD = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n")


@pytest.mark.parametrize("request_bytes", [
    _post("/v1/chat/completions", b'{"model": "m"}'),
    _CHUNKED_HEAD + b'e\r\n{"model": "m"}\r\n0\r\n\r\n',  # aiohttp reads this one
], ids=["front", "aiohttp"])
def test_a_body_that_arrived_while_the_host_stalled_is_read(request_bytes: bytes) -> None:
    """As a head (above): when the process stalls past client_timeouts.body_s, the body
    timer fires before the loop reads the body that arrived meanwhile. The router must
    look again before answering 408 (the real-vLLM tier met this: a host stall while two
    CPU engines ran turned a hedged stream into a 408)."""
    answer = _answer_across_a_stall(request_bytes[:-12], request_bytes[-12:],
                                    header_timeout_s=5.0, body_timeout_s=0.3)
    assert answer.startswith(b"HTTP/1.1 200 "), answer
    assert answer.endswith(b'{"model": "m"}'), answer


async def test_stopping_the_site_lets_a_stream_in_progress_finish() -> None:
    chunks = [b"data: %d\n\n" % n for n in range(10)]

    async def slow_worker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError):
            while True:  # keep-alive: the router's pool sends the next request here
                await reader.readuntil(b"\r\n\r\n")
                writer.write(_SSE_HEAD)
                for chunk in chunks:
                    writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    await writer.drain()
                    await asyncio.sleep(0.05)
                writer.write(b"0\r\n\r\n")
                await writer.drain()

    worker, pool, runner, site = await _relay_site(slow_worker)
    port = site.port
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", port)
        idle_writer.write(_post("/v1/chat/completions", b"{}"))  # served: idle after it
        assert (await _read_answer(idle_reader)).status == 200
        writer.write(_post("/v1/chat/completions", b"{}"))
        async with asyncio.timeout(5):
            started = await reader.readuntil(b"data: 0")
        stopping = asyncio.create_task(runner.cleanup())  # SIGTERM, as `run` handles it
        answer = started + await within(reader.read(), 5)  # to its end, then EOF
        assert b"data: 9\n\n\r\n0\r\n\r\n" in answer  # every event and the last chunk
        async with asyncio.timeout(5):
            await stopping
        assert await within(idle_reader.read(), 1) == b""  # idle: closed at once
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", port)  # no longer listening
        writer.close()
        idle_writer.close()
    finally:
        await pool.close()
        worker.close()


async def _echo_site(sock: socket.socket | None = None) -> tuple[web.AppRunner, FrontSite]:
    """A front answering each request with its body; on `sock` (a listening socket shared
    with sibling sites, as router processes share theirs) or a port of its own."""

    async def echo(exchange: Exchange) -> Reply:
        return Reply(200, {"Content-Type": "text/plain"}, await exchange.read_body(5.0))

    runner = web.AppRunner(web.Application())
    await runner.setup()
    site = FrontSite(runner, "127.0.0.1", 0, handler=echo, header_timeout_s=30.0, sock=sock)
    await site.start()
    return runner, site


async def test_stopping_answers_a_connection_whose_first_request_is_on_its_way() -> None:
    """A client that has just connected is about to send its request: stopping must not
    close its connection as idle (it would see it break), but answer that request and
    close after it. One that never sends is closed after FIRST_REQUEST_GRACE_S."""
    runner, site = await _echo_site()
    reader, writer = await asyncio.open_connection("127.0.0.1", site.port)
    silent_reader, silent_writer = await asyncio.open_connection("127.0.0.1", site.port)
    try:
        for _ in range(100):  # both accepted: the front has them
            if len(site.connections) == 2:
                break
            await asyncio.sleep(0.01)
        assert len(site.connections) == 2
        stopped = time.monotonic()
        stopping = asyncio.create_task(runner.cleanup())
        await asyncio.sleep(0.3)
        writer.write(_post("/v1/chat/completions", b"late"))
        answer = await _read_answer(reader)
        assert (answer.status, answer.body) == (200, b"late")
        assert answer.headers.get("connection") == "close"
        assert await within(reader.read(), 1) == b""
        assert await within(silent_reader.read(), 10) == b""
        async with asyncio.timeout(10):
            await stopping
        assert 4.5 < time.monotonic() - stopped < 8  # FIRST_REQUEST_GRACE_S, not header_s
    finally:
        writer.close()
        silent_writer.close()
        await runner.cleanup()


async def test_a_site_stopped_among_siblings_on_one_socket_breaks_no_new_connection() -> None:
    """Router processes share one listening socket; one of them stops (a graceful restart)
    while clients keep opening connections, each sending its request a moment after it
    connects. Every request is answered, by the stopping site or a sibling: none is cut
    while its connection is being set up, or closed before its request came."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=1024)
    port = listener.getsockname()[1]
    broken: list[str] = []
    answered = 0

    async def client(n: int) -> None:
        nonlocal answered
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError as exc:
            broken.append(f"connect {n}: {exc!r}")
            return
        try:
            await asyncio.sleep(0.002 * (n % 5))  # its request follows a moment later
            writer.write(_post("/v1/chat/completions", b"%d" % n, "Connection: close"))
            answer = await _read_answer(reader, timeout_s=10)
            assert (answer.status, answer.body) == (200, b"%d" % n)
            answered += 1
        except (OSError, asyncio.IncompleteReadError, AssertionError) as exc:
            broken.append(f"request {n}: {exc!r}")
        finally:
            writer.close()

    for round_ in range(20):
        sites = [await _echo_site(socket.socket(fileno=os.dup(listener.fileno())))
                 for _ in range(2)]
        clients = [asyncio.create_task(client(n)) for n in range(40)]
        await asyncio.sleep(0.001 * round_)  # the stop falls at a different moment each round
        await sites[0][0].cleanup()
        async with asyncio.timeout(20):
            await asyncio.gather(*clients)
        await sites[1][0].cleanup()
    listener.close()
    assert broken == [], broken[:5]
    assert answered == 20 * 40
