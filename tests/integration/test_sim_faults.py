"""Fault knobs of the simulator, set through its /sim/faults endpoint on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from lab.sim.server import SimServer
from tests.conftest import within
from tests.integration.conftest import StartSim
from worker.engine_metrics import MetricsSample, parse_metrics
from worker.progress import steps_of

pytestmark = pytest.mark.integration

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def set_faults(http: aiohttp.ClientSession, sim: SimServer, **knobs: Any) -> dict[str, Any]:
    async with http.post(sim.url + "/sim/faults", json=knobs) as response:
        assert response.status == 200, await response.text()
        body: dict[str, Any] = await response.json()
        return body


async def chat_status(http: aiohttp.ClientSession, sim: SimServer, **extra: Any) -> int:
    async with http.post(sim.url + "/v1/chat/completions", json={**CHAT, **extra}) as response:
        await response.read()
        return response.status


async def test_knobs_read_and_partial_update(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(error_rate=0.25, slow_factor=2.0)
    async with http.get(sim.url + "/sim/faults") as response:
        assert await response.json() == {
            "error_rate": 0.25,
            "mid_stream_error_rate": 0.0,
            "hang": False,
            "wedge": False,
            "slow_factor": 2.0,
            "busy_in_stream": False,
            "misbehave": "none",
            "slow_token_interval_s": 5.0,
            "unserved": False,
            "unhealthy": False,
            "crash": False,
        }
    knobs = await set_faults(http, sim, unhealthy=True)
    assert knobs["unhealthy"] is True and knobs["error_rate"] == 0.25

    async with http.post(sim.url + "/sim/faults", json={"error_rate": 2}) as response:
        assert response.status == 400
        assert (await response.json())["error"]["type"] == "BadRequestError"
    async with http.post(sim.url + "/sim/faults", json={"no_such_knob": 1}) as response:
        assert response.status == 400
    async with http.get(sim.url + "/sim/faults") as response:
        assert (await response.json())["error_rate"] == 0.25  # refused updates change nothing


async def test_error_rate_answers_500_before_first_byte(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(error_rate=1.0)
    async with http.post(sim.url + "/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
        assert resp.status == 500
        assert resp.content_type == "application/json"
        error = (await resp.json())["error"]
    assert error["type"] == "InternalServerError" and error["code"] == 500
    await set_faults(http, sim, error_rate=0.0)
    assert await chat_status(http, sim) == 200


async def test_error_rate_draws_are_seeded(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    async def pattern(seed: int) -> list[int]:
        sim = await start_sim(error_rate=0.5, seed=seed)
        return [await chat_status(http, sim, max_tokens=1) for _ in range(16)]

    first = await pattern(seed=1)
    assert await pattern(seed=1) == first
    assert {200, 500} == set(first)


async def test_unhealthy_health_is_503(start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    sim = await start_sim()
    await set_faults(http, sim, unhealthy=True)
    async with http.get(sim.url + "/health") as response:
        assert response.status == 503
    assert await chat_status(http, sim) == 200  # unhealthy only changes the health check
    await set_faults(http, sim, unhealthy=False)
    async with http.get(sim.url + "/health") as response:
        assert response.status == 200


async def test_hang_accepts_and_never_answers(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim()
    await set_faults(http, sim, hang=True)
    with pytest.raises(asyncio.TimeoutError):
        async with http.post(
            sim.url + "/v1/chat/completions",
            json=CHAT,
            timeout=aiohttp.ClientTimeout(total=0.3),
        ) as response:
            await response.read()
    async with http.get(sim.url + "/health") as response:
        assert response.status == 200
    await set_faults(http, sim, hang=False)
    assert await chat_status(http, sim) == 200


async def test_clearing_hang_serves_the_requests_still_waiting(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    # An engine that stalled and came back (SIGSTOP then SIGCONT, a starved host): what
    # waited is served then, and not counted by the engine before.
    sim = await start_sim()
    await set_faults(http, sim, hang=True)
    waiting = asyncio.ensure_future(chat_status(http, sim))
    await asyncio.sleep(0.3)
    assert not waiting.done()
    async with http.get(sim.url + "/metrics") as response:
        assert re.search(r"^vllm:num_requests_running\{[^}]*\} 0\.0$", await response.text(),
                         re.MULTILINE)
    await set_faults(http, sim, hang=False)
    assert await within(waiting, 10) == 200


async def engine_metrics(http: aiohttp.ClientSession, sim: SimServer) -> MetricsSample:
    async with http.get(sim.url + "/metrics") as response:
        assert response.status == 200
        return parse_metrics(await response.text())


async def test_a_wedged_engine_counts_what_it_holds_runs_no_step_and_resumes_when_cleared(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    # A wedged accelerator: the engine takes requests in and counts them, /health and
    # /metrics answer, and no step runs; nor is the request of a client that left
    # aborted (an engine core that does not run takes no abort either) until it is back.
    sim = await start_sim()
    assert await chat_status(http, sim) == 200
    before = await engine_metrics(http, sim)
    await set_faults(http, sim, wedge=True)
    held = [asyncio.ensure_future(chat_status(http, sim)) for _ in range(3)]
    with pytest.raises(asyncio.TimeoutError):
        async with http.post(sim.url + "/v1/chat/completions", json=CHAT,
                             timeout=aiohttp.ClientTimeout(total=0.3)) as response:
            await response.read()
    await asyncio.sleep(0.3)
    wedged = await engine_metrics(http, sim)
    assert wedged.in_flight == 4 and steps_of(wedged) == steps_of(before)
    async with http.get(sim.url + "/health") as response:
        assert response.status == 200
    assert not any(task.done() for task in held)
    await set_faults(http, sim, wedge=False)
    assert await within(asyncio.gather(*held), 10) == [200] * 3
    after = await engine_metrics(http, sim)
    assert after.in_flight == 0  # the abandoned one aborted once the engine ran again
    assert (steps_of(after) or 0) > (steps_of(before) or 0)


@pytest.mark.parametrize("knob", ["hang", "wedge"])
async def test_hung_requests_do_not_hold_up_shutdown(start_sim: StartSim, knob: str) -> None:
    sim = await start_sim()
    async with aiohttp.ClientSession() as http:
        await set_faults(http, sim, **{knob: True})
        pending = asyncio.create_task(chat_status(http, sim))
        await asyncio.sleep(0.05)
        started = time.monotonic()
        await sim.stop()
        assert time.monotonic() - started < 1.0
        if knob == "hang":
            with pytest.raises(aiohttp.ClientError):
                await pending
        else:  # what the wedged engine held is aborted as it stops: an error answer
            assert await pending >= 500


async def test_mid_stream_error_cuts_the_stream(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim()
    await set_faults(http, sim, mid_stream_error_rate=1.0)
    received = b""
    with pytest.raises(aiohttp.ClientPayloadError):
        async with http.post(
            sim.url + "/v1/chat/completions", json={**CHAT, "stream": True}
        ) as response:
            assert response.status == 200
            async for data in response.content.iter_any():
                received += data
    events = [e for e in received.split(b"\n\n") if e]
    assert 2 <= len(events) <= 4  # role chunk + 1..3 tokens
    assert b"[DONE]" not in received and b'finish_reason":"length' not in received

    with pytest.raises(aiohttp.ServerDisconnectedError):
        await chat_status(http, sim)  # non-streaming: the connection drops, no response


async def test_slow_factor_slows_requests(start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    sim = await start_sim(decode_step_ms=10.0)

    async def elapsed() -> float:
        started = time.monotonic()
        assert await chat_status(http, sim) == 200  # 8 steps of 10 ms
        return time.monotonic() - started

    normal = await elapsed()
    await set_faults(http, sim, slow_factor=5.0)
    slow = await elapsed()
    assert slow > 0.35 and slow > 2.5 * normal


# --- misbehave: wrong answers at the HTTP and TCP level, read through a raw socket -------

MISBEHAVE_MAX_TOKENS = 4
MISBEHAVE_CHAT = {**CHAT, "max_tokens": MISBEHAVE_MAX_TOKENS}


class RawReply:
    """What a raw-socket client read: bytes, and how the connection ended within the wait
    (`open`: still open, `eof`: closed by the server, `reset`: a TCP RST)."""

    def __init__(self, data: bytes, ending: str) -> None:
        self.data = data
        self.ending = ending
        head, _, self.body = data.partition(b"\r\n\r\n")
        self.head_complete = b"\r\n\r\n" in data
        lines = head.decode("latin-1").split("\r\n")
        self.status_line = lines[0]
        self.headers = {name.strip().lower(): value.strip()
                        for name, _, value in (line.partition(":") for line in lines[1:])}

    @property
    def content_length(self) -> int:
        return int(self.headers["content-length"])

    def chunks(self) -> list[bytes]:
        """The chunks of a chunked body (an incomplete last chunk is left out)."""
        chunks, rest = [], self.body
        while b"\r\n" in rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line, 16)
            if len(rest) < size + 2:
                break
            chunks.append(rest[:size])
            rest = rest[size + 2:]
        return chunks


async def raw_post(sim: SimServer, body: dict[str, Any], *, wait_s: float = 0.5,
                   path: str = "/v1/chat/completions") -> RawReply:
    """POST `body` on a fresh connection; read until the server closes or `wait_s` passes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", sim.port)
    payload = json.dumps(body).encode()
    writer.write(b"POST %s HTTP/1.1\r\nHost: sim\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(payload), payload))
    received, ending = bytearray(), "open"
    deadline = asyncio.get_running_loop().time() + wait_s
    try:
        while len(received) < 12 * 1024 * 1024:
            remaining = deadline - asyncio.get_running_loop().time()
            async with asyncio.timeout(max(remaining, 0.001)):
                data = await reader.read(1 << 16)
            if not data:
                ending = "eof"
                break
            received += data
    except TimeoutError:
        ending = "open"
    except ConnectionResetError:
        ending = "reset"
    writer.close()
    with contextlib.suppress(ConnectionError):
        await writer.wait_closed()
    return RawReply(bytes(received), ending)


async def settled_task_count(baseline: int, timeout_s: float = 2.0) -> int:
    """The number of tasks once it is back to `baseline` (or after `timeout_s`): handlers
    end a moment after their client closed, when the server sees the connection go."""
    for _ in range(int(timeout_s / 0.02)):
        if len(asyncio.all_tasks()) <= baseline:
            break
        await asyncio.sleep(0.02)
    return len(asyncio.all_tasks())


@pytest.fixture
async def misbehaving(start_sim: StartSim, http: aiohttp.ClientSession
                      ) -> AsyncIterator[Callable[..., Awaitable[SimServer]]]:
    """A simulator playing a misbehave mode; afterwards its handlers must all have ended
    (no task left behind) and it must answer normally again."""
    sims: list[SimServer] = []
    tasks_before: list[int] = []

    async def start(mode: str, **knobs: Any) -> SimServer:
        sim = await start_sim()
        await set_faults(http, sim, misbehave=mode, **knobs)
        sims.append(sim)
        tasks_before.append(len(asyncio.all_tasks()))  # with the engine's, the session's
        return sim

    yield start
    baseline = tasks_before[-1]
    assert await settled_task_count(baseline) <= baseline
    for sim in sims:
        await set_faults(http, sim, misbehave="none")
        assert await chat_status(http, sim) == 200


async def test_misbehave_knob_is_refused_when_unknown(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim()
    async with http.post(sim.url + "/sim/faults", json={"misbehave": "explode"}) as response:
        assert response.status == 400
    async with http.post(sim.url + "/sim/faults",
                         json={"slow_token_interval_s": 0}) as response:
        assert response.status == 400


@pytest.mark.parametrize("stream", [False, True])
async def test_no_answer_reads_the_request_and_never_answers(
    misbehaving: Callable[..., Awaitable[SimServer]], stream: bool
) -> None:
    sim = await misbehaving("no_answer")
    reply = await raw_post(sim, {**MISBEHAVE_CHAT, "stream": stream}, wait_s=0.3)
    assert (reply.data, reply.ending) == (b"", "open")


@pytest.mark.parametrize("stream", [False, True])
async def test_headers_then_hang_sends_a_head_and_nothing_else(
    misbehaving: Callable[..., Awaitable[SimServer]], stream: bool
) -> None:
    sim = await misbehaving("headers_then_hang")
    reply = await raw_post(sim, {**MISBEHAVE_CHAT, "stream": stream}, wait_s=0.3)
    assert reply.ending == "open" and reply.head_complete and reply.body == b""
    assert reply.status_line == "HTTP/1.1 200 OK"
    if stream:
        assert reply.headers["transfer-encoding"] == "chunked"
    else:
        assert reply.content_length > 0


async def test_half_body_close_sends_half_a_json_answer_then_fin(
    misbehaving: Callable[..., Awaitable[SimServer]]
) -> None:
    sim = await misbehaving("half_body_close")
    reply = await raw_post(sim, MISBEHAVE_CHAT)
    assert reply.ending == "eof" and reply.status_line == "HTTP/1.1 200 OK"
    assert 0 < len(reply.body) < reply.content_length
    assert reply.body.startswith(b'{"id":"chatcmpl-')
    with pytest.raises(ValueError):
        json.loads(reply.body)


async def test_half_body_close_streams_half_an_event_then_fin(
    misbehaving: Callable[..., Awaitable[SimServer]]
) -> None:
    sim = await misbehaving("half_body_close")
    reply = await raw_post(sim, {**MISBEHAVE_CHAT, "stream": True})
    assert reply.ending == "eof"
    [chunk] = reply.chunks()
    assert chunk.startswith(b"data: {") and b"\n\n" not in chunk
    assert not reply.body.endswith(b"0\r\n\r\n")  # no last chunk: the stream broke off


@pytest.mark.parametrize("stream", [False, True])
async def test_wrong_content_length_declares_more_than_it_sends(
    misbehaving: Callable[..., Awaitable[SimServer]], stream: bool
) -> None:
    sim = await misbehaving("wrong_content_length")
    reply = await raw_post(sim, {**MISBEHAVE_CHAT, "stream": stream})
    assert reply.ending == "eof"
    assert reply.content_length == len(reply.body) + 100
    if stream:
        assert reply.body.endswith(b"data: [DONE]\n\n")
    else:
        assert json.loads(reply.body)["choices"][0]["finish_reason"] == "length"


async def test_short_content_length_sends_more_than_it_declares(
    misbehaving: Callable[..., Awaitable[SimServer]]
) -> None:
    sim = await misbehaving("short_content_length")
    reply = await raw_post(sim, MISBEHAVE_CHAT, wait_s=0.3)
    assert reply.ending == "open"
    assert reply.content_length == len(reply.body) - 100
    json.loads(reply.body)  # the whole answer was sent, past the declared length


async def test_huge_headers_are_ten_megabytes_before_a_valid_answer(
    misbehaving: Callable[..., Awaitable[SimServer]]
) -> None:
    sim = await misbehaving("huge_headers")
    reply = await raw_post(sim, MISBEHAVE_CHAT, wait_s=5.0)
    assert reply.ending == "eof" and reply.head_complete
    assert len(reply.data) - len(reply.body) > 10 * 1024 * 1024
    assert len(reply.body) == reply.content_length
    json.loads(reply.body)


@pytest.mark.parametrize("stream", [False, True])
async def test_endless_body_never_ends(
    misbehaving: Callable[..., Awaitable[SimServer]], stream: bool
) -> None:
    sim = await misbehaving("endless_body")
    reply = await raw_post(sim, {**MISBEHAVE_CHAT, "stream": stream}, wait_s=0.5)
    assert reply.ending == "open" and reply.status_line == "HTTP/1.1 200 OK"
    chunks = reply.chunks()
    assert len(chunks) > 4 * MISBEHAVE_MAX_TOKENS  # far past max_tokens, and on
    assert b"" not in chunks and b"[DONE]" not in reply.body


@pytest.mark.parametrize("stream", [False, True])
async def test_garbage_is_not_http(
    misbehaving: Callable[..., Awaitable[SimServer]], stream: bool
) -> None:
    sim = await misbehaving("garbage")
    reply = await raw_post(sim, {**MISBEHAVE_CHAT, "stream": stream})
    assert reply.ending == "eof" and len(reply.data) == 4096
    assert not reply.data.startswith(b"HTTP/")


async def test_reset_mid_stream_sends_three_tokens_then_rst(
    misbehaving: Callable[..., Awaitable[SimServer]]
) -> None:
    sim = await misbehaving("reset_mid_stream")
    reply = await raw_post(sim, {**MISBEHAVE_CHAT, "stream": True}, wait_s=2.0)
    assert reply.ending == "reset"
    events = [e for e in b"".join(reply.chunks()).split(b"\n\n") if e]
    assert len(events) == 4  # a chat's role chunk, then 3 tokens
    assert all(e.startswith(b"data: {") for e in events)


async def test_reset_mid_stream_cuts_a_json_answer_with_rst(
    misbehaving: Callable[..., Awaitable[SimServer]]
) -> None:
    sim = await misbehaving("reset_mid_stream")
    reply = await raw_post(sim, MISBEHAVE_CHAT, wait_s=2.0)
    assert reply.ending == "reset"
    assert 0 < len(reply.body) < reply.content_length


async def test_slow_tokens_pace_a_valid_stream(
    misbehaving: Callable[..., Awaitable[SimServer]]
) -> None:
    sim = await misbehaving("slow_tokens", slow_token_interval_s=0.2)
    reply = await raw_post(sim, {**MISBEHAVE_CHAT, "max_tokens": 3, "stream": True},
                           wait_s=0.3)
    assert reply.ending == "open" and reply.head_complete  # the head at once
    assert len(reply.chunks()) == 1  # the role chunk and the first token, after 0.2 s
    started = time.monotonic()
    reply = await raw_post(sim, {"prompt": "Hi", "max_tokens": 3, "stream": True},
                           wait_s=3.0, path="/v1/completions")
    assert reply.body.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    assert time.monotonic() - started >= 0.6


async def test_slow_tokens_delay_a_json_answer(
    misbehaving: Callable[..., Awaitable[SimServer]], http: aiohttp.ClientSession
) -> None:
    sim = await misbehaving("slow_tokens", slow_token_interval_s=0.1)
    started = time.monotonic()
    assert await chat_status(http, sim, max_tokens=3) == 200
    assert time.monotonic() - started >= 0.3


@pytest.mark.parametrize("mode", ["no_answer", "headers_then_hang", "short_content_length",
                                  "endless_body", "slow_tokens"])
async def test_misbehaving_requests_do_not_hold_up_shutdown(
    start_sim: StartSim, mode: str
) -> None:
    sim = await start_sim()
    async with aiohttp.ClientSession() as http:
        await set_faults(http, sim, misbehave=mode)
        _, writer = await asyncio.open_connection("127.0.0.1", sim.port)
        payload = json.dumps({**CHAT, "stream": True}).encode()
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: sim\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        await asyncio.sleep(0.1)
        started = time.monotonic()
        await sim.stop()
        assert time.monotonic() - started < 1.5
        writer.close()


async def test_arrivals_count_completion_requests_since_the_last_change(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim()
    before_s = time.time()
    await set_faults(http, sim, misbehave="garbage")
    for _ in range(3):
        await raw_post(sim, CHAT, wait_s=0.5)
    async with http.get(sim.url + "/health"):
        pass  # not a completion request: not counted
    async with http.get(sim.url + "/sim/arrivals") as response:
        arrivals = await response.json()
    assert arrivals["completion_requests"] == 3 and len(arrivals["arrivals_unix_s"]) == 3
    assert before_s <= arrivals["since_unix_s"] <= arrivals["arrivals_unix_s"][0]
    await set_faults(http, sim, misbehave="none")
    async with http.get(sim.url + "/sim/arrivals") as response:
        assert (await response.json())["completion_requests"] == 0


async def test_the_engine_serves_misbehaving_requests_as_usual(
    misbehaving: Callable[..., Awaitable[SimServer]], http: aiohttp.ClientSession
) -> None:
    """Its metrics (and so the agent's heartbeats) look healthy: only the answer is wrong."""
    sim = await misbehaving("no_answer")

    async def generated_tokens() -> float:
        async with http.get(sim.url + "/metrics") as response:
            text = await response.text()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:generation_tokens_total"))

    before = await generated_tokens()
    reply = await raw_post(sim, MISBEHAVE_CHAT, wait_s=0.3)
    assert reply.data == b""
    assert await generated_tokens() - before == MISBEHAVE_CHAT["max_tokens"]
