"""The router's HTTP surface attacked at the protocol level, on raw sockets.

What a client library would hide: compressed and chunked bodies (bombs, slow ones,
lying chunk sizes), ambiguous framing (Content-Length with Transfer-Encoding, two
lengths, folded or NUL-bearing headers: request smuggling), heads of 10,000 headers,
`Expect: 100-continue`, HTTP/1.0, pipelining on a handed-over connection, clients that
half-close or reset mid-request, and absurd but well-formed OpenAI bodies (duplicate
JSON keys, lone surrogates, NaN, huge `model`, `n`, `max_tokens` of the wrong JSON type).

Each answer must be an OpenAI-format JSON error or a correct answer; nothing ambiguous
may reach a worker (a recording worker sees the exact bytes the router sends), no
internal address may leak, and a client that goes away must stop its worker and leave
no task behind. Each test asserts the correct behaviour (the faults it found are fixed).
"""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import struct
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, cast

import pytest

from lab.sim.server import SimServer
from router.app import HOLDER
from router.proxy.front import TASK_NAME
from tests.integration.test_proxy import CHAT, Fleet, FleetFactory, fleet_factory
from tests.integration.test_security_fleet import API_KEYS, auth_section, secure_fleet
from tests.integration.test_security_fleet import FleetFactory as SecureFleetFactory

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

__all__ = ["fleet_factory", "secure_fleet"]  # the fixtures, shared with their modules

CHAT_PATH = "/v1/chat/completions"
BODY = json.dumps(CHAT).encode()


# -- raw HTTP/1.x on asyncio streams --

def _post(body: bytes, *lines: str, version: str = "1.1", length: bool = True) -> bytes:
    """A POST to chat completions with `lines` after Host and Content-Type; its
    Content-Length unless `length` is False."""
    head = [f"POST {CHAT_PATH} HTTP/{version}", "Host: router", "Content-Type: application/json",
            *([f"Content-Length: {len(body)}"] if length else []), *lines]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def _chunked(body: bytes, *lines: str, pieces: int = 1) -> bytes:
    """`body` as a chunked upload in `pieces` chunks."""
    size = -(-len(body) // pieces) if body else 1
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + size]), body[i:i + size])
                      for i in range(0, len(body), size))
    return _post(b"", "Transfer-Encoding: chunked", *lines, length=False) + chunks + b"0\r\n\r\n"


@dataclass
class Answer:
    version: str
    status: int
    headers: dict[str, str]
    body: bytes
    interim: list[int] = field(default_factory=list)  # 1xx statuses seen before it

    def error(self) -> dict[str, Any]:
        """The OpenAI error object of a JSON error answer (asserts it is one)."""
        assert self.headers.get("content-type", "").startswith("application/json"), (
            self.status, self.headers, self.body[:300])
        document = json.loads(self.body)
        error = document["error"]
        assert set(error) >= {"message", "type", "param", "code"}, document
        return cast(dict[str, Any], error)


async def _connect(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port), limit=1 << 22)


async def _read_answer(reader: asyncio.StreamReader, timeout_s: float = 10.0) -> Answer:
    """One answer: Content-Length, chunked, or (HTTP/1.0) until the connection closes."""
    async with asyncio.timeout(timeout_s):
        interim: list[int] = []
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            version, status_text = lines[0].split(" ")[:2]
            if not status_text.startswith("1"):
                break
            interim.append(int(status_text))
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        if headers.get("transfer-encoding") == "chunked":
            body = b""
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    await reader.readuntil(b"\r\n")  # (no trailers sent to these clients)
                    break
                body += (await reader.readexactly(size + 2))[:-2]
        elif "content-length" in headers:
            body = await reader.readexactly(int(headers["content-length"]))
        else:
            body = await reader.read(-1)  # close-delimited
    return Answer(version, int(status_text), headers, body, interim)


async def _ask(url: str, data: bytes, timeout_s: float = 10.0) -> Answer:
    """Send `data` on a new connection and read one answer."""
    reader, writer = await _connect(url)
    try:
        writer.write(data)
        return await _read_answer(reader, timeout_s)
    finally:
        writer.close()


async def _closed(reader: asyncio.StreamReader, timeout_s: float = 5.0) -> bool:
    """Whether the peer closes (EOF or reset) within `timeout_s`, dropping what it sends."""
    try:
        async with asyncio.timeout(timeout_s):
            while await reader.read(65536):
                pass
    except TimeoutError:
        return False
    except ConnectionError:
        pass
    return True


# -- a worker that records the exact bytes the router sends it --

class RecordingWorker:
    """Answers every request (SSE when its JSON says `stream`, as `json.loads` reads it:
    the last of duplicate keys, as vLLM's FastAPI does) and keeps each raw request."""

    def __init__(self) -> None:
        self.requests: list[tuple[bytes, bytes]] = []  # (head, body)
        self.url = ""
        self._server: asyncio.Server | None = None

    async def start(self) -> RecordingWorker:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lengths = [int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")]
                body = await reader.readexactly(lengths[0] if len(lengths) == 1 else 0)
                self.requests.append((head, body))
                if json.loads(body).get("stream") is True:
                    event = (b'data: {"id":"x","object":"chat.completion.chunk","model":"m",'
                             b'"choices":[{"index":0,"delta":{"content":"hi"},'
                             b'"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n')
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                                 b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
                                 % (len(event), event))
                else:
                    answer = json.dumps({
                        "id": "x", "object": "chat.completion", "model": "m",
                        "choices": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": "ok"}}],
                    }).encode()
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: %d\r\n\r\n%s" % (len(answer), answer))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()


async def _recorded_fleet(fleet_factory: FleetFactory, **changes: Any
                          ) -> tuple[Fleet, RecordingWorker]:
    """A router whose one worker, "a", is a RecordingWorker (its simulator unused)."""
    fleet = await fleet_factory({"a": "us-east"}, **changes)
    worker = await RecordingWorker().start()
    fleet.sims["a"] = cast(SimServer, worker)  # the fleet's heartbeats advertise its url
    await fleet.publish("a")
    deadline = time.monotonic() + 5
    while fleet.runner.app[HOLDER].current.workers["a"].endpoint != worker.url:
        assert time.monotonic() < deadline, "the router never saw the recording worker"
        await asyncio.sleep(0.02)
    return fleet, worker


def _front_tasks() -> int:
    return sum(1 for task in asyncio.all_tasks() if task.get_name() == TASK_NAME)


def _internal(fleet: Fleet, answer: Answer) -> None:
    """Asserts the answer names no worker address."""
    for sim in fleet.sims.values():
        address = sim.url.removeprefix("http://")
        assert address.encode() not in answer.body, answer.body[:300]
        assert address not in json.dumps(answer.headers), answer.headers


# ======================= framing: what reaches a worker =======================

AMBIGUOUS = {
    "content-length-and-chunked": _post(b"", f"Content-Length: {len(BODY)}",
                                        "Transfer-Encoding: chunked", length=False)
    + b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY),
    "content-length-and-identity": _post(BODY, "Transfer-Encoding: identity"),
    "two-equal-lengths": _post(BODY, f"Content-Length: {len(BODY)}"),
    "length-list": _post(BODY, f"Content-Length: {len(BODY)}, {len(BODY)}", length=False),
    "obs-fold": _post(BODY, "X-A: a", " folded"),
    "nul-in-value": _post(BODY, "X-A: a\x00b"),
    "space-before-colon": _post(BODY, "Transfer-Encoding : chunked"),
    "chunk-size-overflow": _post(b"", "Transfer-Encoding: chunked", length=False)
    + b"ffffffffffffffffffffff\r\n" + BODY + b"\r\n0\r\n\r\n",
    "chunk-size-not-hex": _post(b"", "Transfer-Encoding: chunked", length=False)
    + b"zz\r\n" + BODY + b"\r\n0\r\n\r\n",
}


async def test_ambiguous_framing_is_refused_and_nothing_reaches_a_worker(
    fleet_factory: FleetFactory,
) -> None:
    fleet, worker = await _recorded_fleet(fleet_factory)
    for name, data in AMBIGUOUS.items():
        reader, writer = await _connect(fleet.router_url)
        try:
            writer.write(data)
            answer = await _read_answer(reader, 5)
            assert answer.status == 400, (name, answer)
            assert await _closed(reader), f"{name}: the connection stayed open"
        finally:
            writer.close()
    # A request smuggled inside a body: only the framing the router read counts.
    smuggled = BODY[:-1] + b', "x": "\r\n\r\nPOST /v1/completions HTTP/1.1\r\n\r\n"}'
    answer = await _ask(fleet.router_url, _post(smuggled))
    assert answer.status == 400  # a raw CR/LF in a JSON string: invalid JSON
    assert worker.requests == []


async def test_a_worker_gets_one_request_framed_by_its_content_length(
    fleet_factory: FleetFactory,
) -> None:
    """Whatever framing the client used (chunked in pieces, with chunk extensions and
    trailers, gzip, headers that are not tokens), the worker gets one request with one
    Content-Length that matches its body, and none of the client's framing headers."""
    fleet, worker = await _recorded_fleet(fleet_factory)
    with_extension = _chunked(BODY, pieces=3).replace(b"\r\n0\r\n\r\n",
                                                      b"\r\n0;ext=1\r\nX-Trailer: t\r\n\r\n")
    zipped = gzip.compress(BODY)
    requests = [
        _chunked(BODY, pieces=5),
        with_extension,
        _post(b"", "Content-Encoding: gzip", "Transfer-Encoding: chunked", length=False)
        + b"%x\r\n%s\r\n0\r\n\r\n" % (len(zipped), zipped),
        _post(BODY, "X Spaced Name: v", "Te: trailers", "Connection: keep-alive, Te"),
        _post(BODY, version="1.0"),
    ]
    for data in requests:
        answer = await _ask(fleet.router_url, data)
        assert answer.status == 200, (data[:200], answer)
        assert json.loads(answer.body)["object"] == "chat.completion"
        _internal(fleet, answer)
    assert len(worker.requests) == len(requests)
    for head, body in worker.requests:
        lines = [line.lower() for line in head.split(b"\r\n")[1:] if line]
        assert [line for line in lines if line.startswith(b"content-length:")] == [
            b"content-length: %d" % len(body)], head
        for name in (b"transfer-encoding", b"content-encoding", b"te:", b"x spaced",
                     b"x-trailer", b"expect"):
            assert not any(line.startswith(name) for line in lines), head
        assert json.loads(body) == CHAT


async def test_duplicate_json_keys_mean_the_same_to_router_and_worker(
    fleet_factory: FleetFactory,
) -> None:
    """`"stream": false, "stream": true`: the router must stream exactly when the worker
    (json.loads, as FastAPI: the last key wins) does, and the worker gets the body as
    sent. So too for a key spelled with an escape, and bodies the router's fast JSON
    parser refuses (lone surrogates, a BOM) that json.loads reads."""
    fleet, worker = await _recorded_fleet(fleet_factory)
    messages = b'"model":"m","messages":[{"role":"user","content":"hi"}]'
    bodies = [
        b"{" + messages + b',"stream":false,"stream":true}',
        b"{" + messages + b',"stream":true,"stream":false}',
        b"{" + messages + b',"stream":false,"str\\u0065am":true}',
        b'{"model":"m","messages":[{"role":"user","content":"\\ud800\\udfff\\ud800"}],'
        b'"stream":true}',
        b"\xef\xbb\xbf{" + messages + b"}",
        b"{" + messages + b',"temperature":NaN,"top_p":"NaN","stream":true,'
        b'"stream_options":"junk"}',
        b"{" + messages + b',"stream":true,"stream_options":[1,{"include_usage":"yes"}]}',
    ]
    for body in bodies:
        before = len(worker.requests)
        answer = await _ask(fleet.router_url, _post(body))
        assert answer.status == 200, (body, answer)
        (_, sent), = worker.requests[before:]
        assert sent == body  # passed on byte for byte
        worker_streams = json.loads(body).get("stream") is True
        router_streamed = answer.headers.get("content-type", "").startswith("text/event-stream")
        assert router_streamed == worker_streams, body
        if worker_streams:
            assert answer.body.rstrip().endswith(b"data: [DONE]")
        else:
            assert json.loads(answer.body)["object"] == "chat.completion"
    # A lone surrogate in the model: a clear 404, never a crash.
    answer = await _ask(fleet.router_url, _post(
        b'{"model":"m\\ud800","messages":[{"role":"user","content":"x"}]}'))
    assert (answer.status, answer.error()["code"]) == (404, "model_not_found")
    assert len(worker.requests) == len(bodies)


# ======================= bodies: compressed, slow, lying =======================

async def test_a_slow_or_short_chunked_body_gets_a_408(fleet_factory: FleetFactory) -> None:
    """Slowloris on the body: a chunked body dribbled a byte at a time, and one whose
    chunk promises more than comes, end in a JSON 408 after client_timeouts.body_s
    (1 s), never reaching the worker."""
    fleet = await fleet_factory({"a": "us-east"}, client_timeouts={"body_s": 1.0})
    reader, writer = await _connect(fleet.router_url)
    try:
        writer.write(_post(b"", "Transfer-Encoding: chunked", length=False))
        started = time.monotonic()

        async def dribble() -> None:
            for byte in BODY:
                writer.write(b"1\r\n%c\r\n" % byte)
                await asyncio.sleep(0.2)

        dribbling = asyncio.ensure_future(dribble())
        try:
            answer = await _read_answer(reader, 6)
        finally:
            dribbling.cancel()
        assert answer.status == 408 and "did not arrive" in answer.error()["message"]
        assert 0.9 < time.monotonic() - started < 4
    finally:
        writer.close()
    lying = _post(b"", "Transfer-Encoding: chunked", length=False) + b"%x\r\n%s\r\n" % (
        len(BODY) + 10, BODY)
    answer = await _ask(fleet.router_url, lying, 6)
    assert answer.status == 408
    answer.error()
    assert await fleet.running("a") == 0


@pytest.mark.parametrize("kind", ["chunked-5MiB", "gzip-bomb-chunked", "gzip-bomb-http1.0"])
async def test_a_body_over_the_limit_read_by_aiohttp_is_a_413(
    fleet_factory: FleetFactory, kind: str,
) -> None:
    fleet = await fleet_factory({"a": "us-east"})
    bomb = gzip.compress(b" " * (64 << 20), 9)  # 64 KiB that inflates to 64 MiB
    assert len(bomb) < 100_000
    data = {
        "chunked-5MiB": _chunked(b" " * (5 << 20) + BODY, pieces=8),
        "gzip-bomb-chunked": _post(b"", "Content-Encoding: gzip", "Transfer-Encoding: chunked",
                                   length=False) + b"%x\r\n%s\r\n0\r\n\r\n" % (len(bomb), bomb),
        "gzip-bomb-http1.0": _post(bomb, "Content-Encoding: gzip", version="1.0"),
    }[kind]
    started = time.monotonic()
    answer = await _ask(fleet.router_url, data)
    assert time.monotonic() - started < 5  # the bomb is not inflated whole
    assert answer.status == 413, answer
    answer.error()


async def test_a_compressed_body_gets_the_same_answer_on_every_path(
    fleet_factory: FleetFactory,
) -> None:
    fleet = await fleet_factory({"a": "us-east"})
    answers = {}
    for encoding, data in (("gzip", gzip.compress(BODY)), ("deflate", zlib.compress(BODY))):
        front = await _ask(fleet.router_url, _post(data, f"Content-Encoding: {encoding}"))
        handed = await _ask(fleet.router_url, _post(
            b"", f"Content-Encoding: {encoding}", "Transfer-Encoding: chunked", length=False)
            + b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data))
        answers[encoding] = (front.status, handed.status)
    assert all(front == handed for front, handed in answers.values()), answers


async def test_a_body_that_does_not_inflate_is_a_400_and_its_connection_closes(
    fleet_factory: FleetFactory,
) -> None:
    """A gzip body whose data does not inflate: a JSON 400 `malformed_body`, and nothing
    after it on that connection is read (its framing cannot be trusted)."""
    fleet = await fleet_factory({"a": "us-east"})
    broken = gzip.compress(BODY)[:-12] + b"not gzip at all"
    reader, writer = await _connect(fleet.router_url)
    try:
        writer.write(_post(broken, "Content-Encoding: gzip"))
        answer = await _read_answer(reader)
        assert answer.status == 400 and answer.error()["code"] == "malformed_body", answer
        assert await _closed(reader)
    finally:
        writer.close()


# ======================= heads =======================

@pytest.mark.parametrize("name", ["content-length-and-chunked", "two-equal-lengths",
                                  "obs-fold", "nul-in-value", "chunk-size-not-hex",
                                  "br-encoding", "unknown-expect"])
async def test_protocol_errors_are_openai_json(fleet_factory: FleetFactory, name: str) -> None:
    fleet = await fleet_factory({"a": "us-east"})
    data = {
        **AMBIGUOUS,
        "br-encoding": _post(b"", "Content-Encoding: br", "Transfer-Encoding: chunked",
                             length=False) + b"5\r\nhello\r\n0\r\n\r\n",
        "unknown-expect": _post(BODY, "Expect: 200-ok"),
    }[name]
    answer = await _ask(fleet.router_url, data)
    assert 400 <= answer.status < 500
    assert answer.error()["type"] == "invalid_request_error"


async def test_a_head_of_ten_thousand_headers_is_refused(fleet_factory: FleetFactory) -> None:
    fleet = await fleet_factory({"a": "us-east"})
    many = _post(BODY, *(f"h{i}:v" for i in range(10_000)))
    answer = await _ask(fleet.router_url, many)
    assert answer.status in (400, 431), (answer.status, answer.headers.get("server"))
    answer.error()


async def test_oversized_heads_are_refused_and_the_router_stays_up(
    fleet_factory: FleetFactory,
) -> None:
    fleet = await fleet_factory({"a": "us-east"})
    # A 1 MiB header: refused (aiohttp's 8190-byte line limit), connection closed.
    reader, writer = await _connect(fleet.router_url)
    try:
        writer.write(_post(BODY, "X-Big: " + "a" * (1 << 20)))
        async with asyncio.timeout(5):
            head = await reader.readuntil(b"\r\n\r\n")
        assert head.split(b" ")[1] == b"400"
        assert await _closed(reader)
    except ConnectionResetError:
        pass  # (its 400 can be lost to the reset of the unread megabyte: refused either way)
    finally:
        writer.close()
    # 10,000 headers forced through aiohttp (HTTP/1.0): refused.
    answer = await _ask(fleet.router_url, _post(BODY, *(f"h{i}:v" for i in range(10_000)),
                                                version="1.0"))
    assert answer.status == 400
    assert await fleet.running("a") == 0
    answer = await _ask(fleet.router_url, _post(BODY))
    assert answer.status == 200  # and the router serves on


# ======================= Expect, HTTP/1.0, pipelining =======================

async def test_expect_100_continue_is_refused_before_the_body_is_asked_for(
    secure_fleet: SecureFleetFactory,
) -> None:
    fleet = await secure_fleet({"a": "us-east"})
    key = f"Authorization: Bearer {API_KEYS['acme']}"
    for lines, status in (((key,), 413), ((), 401)):
        reader, writer = await _connect(fleet.urls[0])
        try:
            writer.write(_post(b"", *lines, "Expect: 100-continue", length=False)[:-2]
                         + b"Content-Length: 99999999\r\n\r\n")
            answer = await _read_answer(reader, 5)
            assert answer.status == status
            answer.error()
            assert answer.interim == [], f"'100 Continue' before the {status}"
        finally:
            writer.close()


async def test_expect_100_continue_within_the_limit_is_served(
    fleet_factory: FleetFactory,
) -> None:
    fleet = await fleet_factory({"a": "us-east"})
    reader, writer = await _connect(fleet.router_url)
    try:
        writer.write(_post(b"", "Expect: 100-continue", length=False)[:-2]
                     + b"Content-Length: %d\r\n\r\n" % len(BODY))
        async with asyncio.timeout(5):
            continued = await reader.readuntil(b"\r\n\r\n")
        assert continued == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(BODY)
        answer = await _read_answer(reader)
        assert answer.status == 200 and json.loads(answer.body)["object"] == "chat.completion"
    finally:
        writer.close()


async def test_http_1_0_is_answered_in_http_1_0_and_closed(fleet_factory: FleetFactory) -> None:
    fleet = await fleet_factory({"a": "us-east"})
    for stream in (False, True):
        body = json.dumps({**CHAT, "stream": stream}).encode()
        reader, writer = await _connect(fleet.router_url)
        try:
            writer.write(_post(body, version="1.0"))
            answer = await _read_answer(reader)  # a stream: delimited by the close
            assert (answer.version, answer.status) == ("HTTP/1.0", 200)
            assert "chunked" not in answer.headers.get("transfer-encoding", "")
            if stream:
                assert answer.body.rstrip().endswith(b"data: [DONE]")
            else:
                assert json.loads(answer.body)["object"] == "chat.completion"
            assert await _closed(reader)
        finally:
            writer.close()


async def test_pipelined_requests_on_a_handed_over_connection_stay_in_order(
    fleet_factory: FleetFactory,
) -> None:
    """Chunked uploads (which aiohttp serves) and a Content-Length one, streams and a
    whole answer, in one write: three answers in order, none mixed with another."""
    fleet = await fleet_factory({"a": "us-east"})
    stream = json.dumps({**CHAT, "stream": True, "max_tokens": 8}).encode()
    whole = json.dumps({**CHAT, "max_tokens": 3}).encode()
    reader, writer = await _connect(fleet.router_url)
    try:
        writer.write(_chunked(stream, "x-request-id: one", pieces=2)
                     + _chunked(whole, "x-request-id: two")
                     + _post(stream, "x-request-id: three"))
        answers = [await _read_answer(reader) for _ in range(3)]
    finally:
        writer.close()
    assert [a.headers["x-request-id"] for a in answers] == ["one", "two", "three"]
    assert [a.status for a in answers] == [200, 200, 200]
    for answer in (answers[0], answers[2]):
        events = [e for e in answer.body.split(b"\n\n") if e.strip()]
        assert events[-1] == b"data: [DONE]"
        ids = {json.loads(e.removeprefix(b"data: "))["id"] for e in events[:-1]}
        assert len(ids) == 1  # one completion's events only
    assert json.loads(answers[1].body)["object"] == "chat.completion"


# ======================= clients that leave =======================

async def _wait_idle(fleet: Fleet, baseline_tasks: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while await fleet.running("a") or _front_tasks() > baseline_tasks:
        assert time.monotonic() < deadline, (
            f"running={await fleet.running('a')}, front tasks={_front_tasks()}")
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("leave", ["reset", "half-close"])
async def test_a_client_that_leaves_mid_request_stops_its_worker_and_leaks_nothing(
    fleet_factory: FleetFactory, leave: str,
) -> None:
    """RST (SO_LINGER 0) or shutdown(SHUT_WR) mid-request, streamed or not, on the front
    and on aiohttp (chunked upload): the simulator stops generating, no front task or
    router task is left, and the router counts 499s (client gone), not worker faults.
    (A half-close is taken as the client leaving, as nginx does: no answer is owed.)"""
    fleet = await fleet_factory({"a": "us-east"}, decode_step_ms=20.0)
    tasks_before = len(asyncio.all_tasks())
    front_before = _front_tasks()
    for stream in (True, False):
        body = json.dumps({**CHAT, "stream": stream, "max_tokens": 500}).encode()
        for data in (_post(body), _chunked(body)):
            reader, writer = await _connect(fleet.router_url)
            writer.write(data)
            deadline = time.monotonic() + 5
            while await fleet.running("a") == 0:
                assert time.monotonic() < deadline, "the request never reached the worker"
                await asyncio.sleep(0.02)
            if leave == "reset":
                writer.get_extra_info("socket").setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.close()
            else:
                writer.write_eof()
                assert await _closed(reader), "the router kept a half-closed connection"
                writer.close()
            started = time.monotonic()
            await _wait_idle(fleet, front_before)
            assert time.monotonic() - started < 2, "the worker kept generating"
    deadline = time.monotonic() + 3
    while len(asyncio.all_tasks()) > tasks_before:
        assert time.monotonic() < deadline, sorted(t.get_name() for t in asyncio.all_tasks())
        await asyncio.sleep(0.05)
    answer = await _ask(fleet.router_url, _post(json.dumps(CHAT).encode()))
    assert answer.status == 200  # the worker was never blamed
    metrics = await _ask(fleet.router_url, b"GET /metrics HTTP/1.1\r\nHost: r\r\n\r\n")
    lines = metrics.body.decode().splitlines()
    left = [line for line in lines if line.startswith("globalpool_client_disconnects_total{")]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in left) >= 4, left


# ======================= absurd but well-formed bodies =======================

async def test_absurd_bodies_get_clear_answers(fleet_factory: FleetFactory) -> None:
    """max_tokens 10^12, n 10^6, 100,000 messages, 1 MiB of `model`: each a clear
    OpenAI-format answer (the engine's own 400 where it refuses), no 5xx, no address."""
    fleet = await fleet_factory({"a": "us-east"})
    message = {"role": "user", "content": "x"}
    cases: list[tuple[dict[str, Any], set[int]]] = [
        ({**CHAT, "max_tokens": 10**12}, {400}),  # the engine: over the context length
        ({**CHAT, "n": 10**6}, {400}),  # the engine (the simulator's bound on n)
        # (the engine may find 100,000 messages over its context length)
        ({**CHAT, "max_tokens": 1, "messages": [message] * 100_000}, {200, 400}),
        ({**CHAT, "model": "q" * (1 << 20)}, {404}),
        ({**CHAT, "stream": "true"}, {400}),
        ({**CHAT, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": 1}},
         {200}),
    ]
    for document, statuses in cases:
        answer = await _ask(fleet.router_url, _post(json.dumps(document).encode()), 20)
        assert answer.status in statuses, (str(document)[:200], answer.body[:300])
        _internal(fleet, answer)
        if answer.status != 200:
            answer.error()
    assert await fleet.running("a") == 0


async def test_an_unknown_huge_model_is_not_echoed_whole(fleet_factory: FleetFactory) -> None:
    fleet = await fleet_factory({"a": "us-east"})
    answer = await _ask(fleet.router_url, _post(json.dumps(
        {**CHAT, "model": "q" * (1 << 20)}).encode()))
    assert 400 <= answer.status < 500
    assert len(answer.error()["message"]) < 4096


@pytest.mark.parametrize("changes", [
    {"max_completion_tokens": None, "max_tokens": 2000},
    {"max_tokens": 2000.0},
    {"max_tokens": "2000"},
    {"n": "8", "max_tokens": 200},
], ids=["null-max-completion-tokens", "float-max-tokens", "string-max-tokens", "string-n"])
async def test_token_limits_charge_what_the_engine_will_generate(
    secure_fleet: SecureFleetFactory, changes: dict[str, Any],
) -> None:
    fleet = await secure_fleet({"a": "us-east"}, auth=auth_section(
        acme={"key_limits": {"tokens_per_min": 1000}}))
    key = f"Authorization: Bearer {API_KEYS['acme']}"
    control = await _ask(fleet.urls[0], _post(json.dumps(
        {**CHAT, "max_tokens": 2000}).encode(), key))
    assert (control.status, control.error()["code"]) == (429, "request_too_large")
    body = json.dumps({**CHAT, "stream": True, **changes}).encode()
    reader, writer = await _connect(fleet.urls[0])
    try:
        writer.write(_post(body, key))
        async with asyncio.timeout(10):
            head = await reader.readuntil(b"\r\n\r\n")
    finally:
        writer.close()  # (a stream admitted by mistake: leave, its worker stops)
    assert head.split(b" ")[1] in (b"400", b"429"), head.split(b"\r\n")[0]
