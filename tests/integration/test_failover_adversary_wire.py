"""Mid-stream failover (issue 26) against what a worker can put on the wire: the client
reads one whole stream, or one error event that names no engine.

Worker `a` is the router's first pick and breaks its stream; `b` (then `c`) continues it.
Scripted raw-socket workers (tests.integration.scripted_workers) play the shapes a
simulator cannot make: an event cut in half, an error event read together with a token, a
tool call. In-process simulators play the rest with their fault knobs: a body framed
short, garbage, headers then silence, a refusal, a slow continuation. Real Valkey and a
real router (test_failover_adversary's), nothing of the project mocked.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from tests.conftest import within
from tests.integration.conftest import StartSim
from tests.integration.operators_fleet import scrape, value
from tests.integration.scripted_workers import (
    ROLE_T1,
    SECRET,
    SSE_HEAD,
    T2,
    Play,
    Scripted,
    chat_chunk,
    continuation_answer,
    error_event,
    http_chunk,
    playing,
    send,
    sse,
)
from tests.integration.test_failover_adversary import (
    CHAT_PATH,
    StartRouter,
    assert_one_whole_stream,
    errors_in,
    events_of,
    post_stream,
    start_router,
    token_events,
)
from tests.integration.test_stream_failover import CHAT, COMPLETION, TOKENS

__all__ = ["start_router"]
pytestmark = pytest.mark.integration

T3 = http_chunk(chat_chunk(" t3"))
# " t3" comes in the read of the error event, with the first byte of a next chunk (so
# that the general parser decodes it): " t3" is owed to the client when the break is found.
OWED_T3 = playing(ROLE_T1, T2, T3 + http_chunk(error_event()) + b"e", linger_s=0.2)
ScriptedRouter = Callable[..., Awaitable[tuple[str, list[Scripted]]]]
SimURLs = Callable[..., Awaitable[list[str]]]


@pytest.fixture
async def scripted_router(start_router: StartRouter) -> AsyncIterator[ScriptedRouter]:
    """`await scripted_router(*plays)`: scripted workers a, b, c..., one a play, and the
    URL of a router in front of them (`a` its first pick); the workers stop afterwards."""
    workers: list[Scripted] = []

    async def start(*plays: Play) -> tuple[str, list[Scripted]]:
        started: list[Scripted] = []
        for play in plays:
            started.append(await Scripted(play).start())
            workers.append(started[-1])
        return await start_router(*(worker.url for worker in started)), started

    yield start
    for worker in workers:
        await worker.stop()


@pytest.fixture
def sim_urls(start_sim: StartSim) -> SimURLs:
    """`await sim_urls(count, **changes)`: the URLs of `count` in-process simulators."""

    async def start(count: int, **changes: Any) -> list[str]:
        return [(await start_sim(served_model_names=("m",), seed=seed, **changes)).url
                for seed in range(1, count + 1)]

    return start


async def began_on_a(router: str, body: dict[str, Any] = CHAT, path: str = CHAT_PATH,
                     headers: dict[str, str] | None = None) -> bytes:
    """The whole stream, which must have begun, with a 200, on worker `a`."""
    status, worker, answer = await post_stream(router, path, body, headers)
    assert (status, worker) == (200, "a")
    return answer


async def faults(url: str, **knobs: object) -> None:
    async with aiohttp.ClientSession() as session, session.post(
            f"{url}/sim/faults", json=knobs) as response:
        assert response.status == 200, await response.text()


async def sim_running(url: str) -> float:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as response:
        text = await response.text()
    line = next(x for x in text.splitlines() if x.startswith("vllm:num_requests_running{"))
    return float(line.rsplit(" ", 1)[1])


async def arrivals(url: str) -> int:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/sim/arrivals") as r:
        return int((await r.json())["completion_requests"])


# === what the wire can do to the relay (scripted workers) ===========================


async def test_an_event_cut_in_half_by_the_break_never_reaches_the_client(
        scripted_router: ScriptedRouter) -> None:
    # a sends three tokens, half of the fourth event, then FIN inside the chunked body. The
    # half event is dropped with the transcript's tail: the continuation's first event is
    # not glued after it (before, the client got the two as one event, not JSON).
    fourth = chat_chunk(" t4 caf\u00e9")
    cut = playing(ROLE_T1, T2, T3, http_chunk(fourth[: len(fourth) - 12]))
    router, _ = await scripted_router(cut, continuation_answer())
    text = assert_one_whole_stream(await began_on_a(router), "chat")
    assert text.startswith(" t1 t2 t3 c0"), text


async def test_an_error_event_read_together_with_a_token_is_caught(
        scripted_router: ScriptedRouter) -> None:
    # vLLM writes each event as its own chunk, but one read can bring several: a token's,
    # then the error event's (the engine died), then [DONE]'s. The relay finds the error
    # anywhere in a read, keeps the engine's words from the client and continues.
    coalesced = T3 + http_chunk(error_event()) + http_chunk(b"data: [DONE]\n\n")
    router, _ = await scripted_router(playing(ROLE_T1, T2, coalesced, b"0\r\n\r\n", keep=True),
                                      continuation_answer())
    answer = await began_on_a(router)
    assert SECRET.encode() not in answer, f"the engine's own error reached the client: " \
                                          f"{answer!r}"
    text = assert_one_whole_stream(answer, "chat")
    assert text.startswith(" t1 t2 t3 c0"), text


async def test_events_owed_before_an_error_survive_a_refused_continuation(
        scripted_router: ScriptedRouter) -> None:
    # The first continuation worker asked refuses (400); " t3", owed to the client, goes to
    # it through the next one. Before, it went with the refused attempt: the client never
    # saw " t3" and was one token short.
    refusals = [0]  # shared: whichever of b and c is asked first refuses
    router, _ = await scripted_router(OWED_T3, continuation_answer(refusals),
                                      continuation_answer(refusals))
    answer = await began_on_a(router)
    assert refusals[0] == 2, answer  # one refused, one continued
    text = assert_one_whole_stream(answer, "chat")
    assert text.startswith(" t1 t2 t3 c0"), text


async def test_owed_events_are_not_counted_twice_when_the_continuation_breaks_too(
        scripted_router: ScriptedRouter) -> None:
    # The first continuation sends the owed " t3" on, two tokens of its own, and dies. The
    # second is asked to continue " t1 t2 t3 c0 c1" with what is left of the budget: " t3"
    # is in the transcript once (before, twice, and the budget one token short).
    asked: list[dict[str, Any]] = []
    full = continuation_answer()

    async def die_once_then_continue(n: int, path: str, request: dict[str, Any],
                                     writer: asyncio.StreamWriter) -> bool:
        asked.append(request)
        if len(asked) == 1:
            await send(writer, SSE_HEAD + http_chunk(chat_chunk(role=True, rid="x")
                                                     + chat_chunk(" c0", rid="x")))
            await send(writer, http_chunk(chat_chunk(" c1", rid="x")))
            return False
        return await full(n, path, request, writer)

    router, _ = await scripted_router(OWED_T3, die_once_then_continue, die_once_then_continue)
    answer = await began_on_a(router)
    assert len(asked) == 2, answer
    assert asked[1]["messages"][-1]["content"] == " t1 t2 t3 c0 c1", asked[1]
    assert asked[1]["max_tokens"] == TOKENS - 5
    text = assert_one_whole_stream(answer, "chat")
    assert text.startswith(" t1 t2 t3 c0 c1 c0"), text


async def test_the_continuation_request_carries_the_text_and_the_rest_of_the_budget(
        scripted_router: ScriptedRouter) -> None:
    # A multi-byte character split across two chunks (and two reads), then a break
    # between events.
    second = chat_chunk(" \u00e9t\u00e9 \U0001f600")
    split = second.index(b"\xf0\x9f") + 2  # inside the emoji's four bytes
    first = playing(ROLE_T1, http_chunk(second[:split]), http_chunk(second[split:]))
    router, (_, b) = await scripted_router(first, continuation_answer())
    request = {**CHAT, "max_tokens": None, "max_completion_tokens": 10, "temperature": 0.7,
               "top_p": 0.9, "seed": 42, "stop": ["\n\n"], "min_tokens": 5,
               "presence_penalty": 0.5}
    text = assert_one_whole_stream(await began_on_a(router, request), "chat", tokens=10)
    assert text.startswith(" t1 \u00e9t\u00e9 \U0001f600 c0"), text
    asked = b.bodies[-1]
    assert asked["max_completion_tokens"] == 8
    assert asked["min_tokens"] == 3
    for name in ("temperature", "top_p", "seed", "stop", "presence_penalty",
                 "stream_options", "ignore_eos", "model", "stream"):
        assert asked[name] == request[name], name
    assert asked["messages"][:-1] == request["messages"]
    assert asked["messages"][-1] == {"role": "assistant",
                                     "content": " t1 \u00e9t\u00e9 \U0001f600"}
    assert asked["continue_final_message"] is True
    assert asked["add_generation_prompt"] is False


async def test_a_break_right_after_the_role_event_is_continued(
        scripted_router: ScriptedRouter) -> None:
    # Nothing to continue yet: b is asked the client's own request, whole.
    router, (_, b) = await scripted_router(playing(SSE_HEAD + http_chunk(chat_chunk(role=True))),
                                           continuation_answer())
    assert_one_whole_stream(await began_on_a(router), "chat")
    assert "continue_final_message" not in b.bodies[-1]
    assert b.bodies[-1]["max_tokens"] == TOKENS


async def test_a_tool_call_in_progress_is_not_continued_and_says_why(
        scripted_router: ScriptedRouter) -> None:
    tool = {"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"ci"}}
    first = playing(SSE_HEAD + http_chunk(chat_chunk(role=True)),
                    http_chunk(chat_chunk(tool=tool)))
    router, (_, b) = await scripted_router(first, continuation_answer())
    body = {**CHAT, "tools": [{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object"}}}]}
    _, _, answer = await post_stream(router, CHAT_PATH, body)
    events = events_of(answer)
    errors = errors_in(events)
    assert errors and errors[0]["error"]["code"] == "upstream_failed", answer
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert b"127.0.0.1" not in answer
    assert b.bodies == []
    metrics = await scrape(router)
    assert value(metrics, "globalpool_stream_failovers_total", outcome="not_continued",
                 reason="a tool call in progress") >= 1


# === simulator fault knobs ===========================================================


async def test_a_body_that_ends_inside_an_event_is_not_passed_off_as_the_end(
        start_router: StartRouter, sim_urls: SimURLs) -> None:
    # a's stream is framed 100 bytes short (Content-Length): the body "ends" inside its
    # last token's event, before [DONE]. That is a break, continued like any other (before,
    # the relay passed the half event on and ended the stream there).
    a, b = await sim_urls(2)
    await faults(a, misbehave="short_content_length")
    answer = await began_on_a(await start_router(a, b), {**CHAT, "stream_options": None})
    assert_one_whole_stream(answer, "chat", usage=False)


async def test_completions_without_max_tokens_keep_the_engines_default_length(
        start_router: StartRouter, sim_urls: SimURLs) -> None:
    # vLLM's (and OpenAI's) /v1/completions default max_tokens is 16 (the simulator made
    # to match): the continuation is asked for what is left of those 16, not for 16 more.
    a, b = await sim_urls(2, default_max_tokens=16)
    await faults(a, mid_stream_error_rate=1.0)
    body = {key: v for key, v in COMPLETION.items() if key != "max_tokens"}
    answer = await began_on_a(await start_router(a, b), body, "/v1/completions")
    assert_one_whole_stream(answer, "completions", tokens=16)


def usage_of(answer: bytes) -> dict[str, Any]:
    """The one usage chunk's counts of a whole stream."""
    usages = [c["usage"] for c in events_of(answer)[:-1] if c.get("usage") and not c["choices"]]
    assert len(usages) == 1, answer
    usage: dict[str, Any] = usages[0]
    return usage


@pytest.mark.parametrize(("path", "body", "kind"), [(CHAT_PATH, CHAT, "chat"),
                                                    ("/v1/completions", COMPLETION, "completions")])
async def test_a_stream_ended_for_having_every_token_still_gets_its_usage(
        start_router: StartRouter, sim_urls: SimURLs, path: str, body: dict[str, Any],
        kind: str) -> None:
    # max_tokens=1 and the engine cut after its token, before its finish event: the router
    # ends the stream itself (finish "length", [DONE]); the client asked for usage
    # (stream_options.include_usage) and gets it there too, with the prompt counted by
    # another engine (/tokenize): the count an unbroken answer of that engine carries.
    a, b = await sim_urls(2)
    await faults(a, mid_stream_error_rate=1.0)
    one_token = {**body, "max_tokens": 1}
    answer = await began_on_a(await start_router(a, b), one_token, path)
    assert_one_whole_stream(answer, kind, tokens=1)
    _, _, unbroken = await post_stream(b, path, one_token)
    expected = usage_of(unbroken)
    assert usage_of(answer) == expected, answer
    assert expected["prompt_tokens"] > 1


def tokenize_answering(answer: bytes | None) -> Play:
    """A worker whose /tokenize answers `answer` (a whole HTTP response; None: never
    answers); any other request gets a continuation."""
    other = continuation_answer()

    async def play(n: int, path: str, request: dict[str, Any],
                   writer: asyncio.StreamWriter) -> bool:
        if path != "/tokenize":
            return await other(n, path, request, writer)
        if answer is None:
            await asyncio.sleep(30)  # (the worker is stopped long before)
            return False
        writer.write(answer)
        await writer.drain()
        return True

    return play


def json_answer(status: str, body: bytes) -> bytes:
    return (b"HTTP/1.1 " + status.encode() + b"\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body)


@pytest.mark.parametrize("answer", [
    None,  # hangs
    json_answer("404 Not Found", b'{"detail":"Not Found"}'),  # no /tokenize (not vLLM)
    json_answer("200 OK", b'{"count":1000000000000,"tokens":[]}'),  # an absurd count
    json_answer("200 OK", b'{"count":-3}'),
    json_answer("200 OK", b'{"count":"12"}'),
    json_answer("200 OK", b"[" * 100_000),  # deeper than any parser's recursion
    json_answer("200 OK", b"\xff\xfe not json"),
], ids=["hangs", "404", "absurd", "negative", "string", "deep", "garbage"])
async def test_a_worker_that_cannot_count_the_prompt_leaves_the_usage_out(
        scripted_router: ScriptedRouter, answer: bytes | None) -> None:
    # The count is the one thing the router cannot make up: when the other worker does not
    # give a believable one in time, the stream still ends whole, without a usage chunk,
    # and the metric says why.
    broken = playing(ROLE_T1)  # the role, " t1", then the connection closes
    router, (_, counter) = await scripted_router(broken, tokenize_answering(answer))
    started = time.monotonic()
    answer_bytes = await began_on_a(router, {**CHAT, "max_tokens": 1})
    assert time.monotonic() - started < 8, "the count was waited for too long"
    assert_one_whole_stream(answer_bytes, "chat", tokens=1, usage=False)
    assert [body.get("messages") for body in counter.bodies] == [CHAT["messages"]]
    metrics = await scrape(router)
    assert value(metrics, "globalpool_stream_failovers_total", outcome="finished",
                 reason="no worker counted the prompt: usage left out") == 1


async def test_no_count_is_asked_for_when_the_client_wants_no_usage(
        scripted_router: ScriptedRouter) -> None:
    router, (_, other) = await scripted_router(playing(ROLE_T1), tokenize_answering(None))
    answer = await began_on_a(router, {**CHAT, "max_tokens": 1, "stream_options": None})
    assert_one_whole_stream(answer, "chat", tokens=1, usage=False)
    assert other.bodies == []


async def test_a_usage_chunk_already_sent_is_not_sent_again(
        scripted_router: ScriptedRouter) -> None:
    # The break came between the usage chunk and [DONE]: only [DONE] is missing.
    usage = sse({"id": "chatcmpl-first", "object": "chat.completion.chunk",
                 "created": 1_700_000_000, "model": "m", "choices": [],
                 "usage": {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8}})
    finish = http_chunk(chat_chunk(finish="length")) + http_chunk(usage)
    router, (_, other) = await scripted_router(playing(ROLE_T1, finish),
                                               tokenize_answering(None))
    answer = await began_on_a(router, {**CHAT, "max_tokens": 1})
    assert_one_whole_stream(answer, "chat", tokens=1)
    assert (usage_of(answer))["prompt_tokens"] == 7
    assert other.bodies == []


@pytest.mark.parametrize("misbehave", ["garbage", "headers_then_hang", "half_body_close"])
async def test_a_continuation_worker_that_answers_wrongly_is_skipped(
        start_router: StartRouter, sim_urls: SimURLs, misbehave: str) -> None:
    a, b, c = await sim_urls(3)
    await faults(a, mid_stream_error_rate=1.0)
    await faults(b, misbehave=misbehave)
    await faults(c, misbehave=misbehave)  # whichever is asked first answers wrongly...
    router = await start_router(a, b, c)
    answer = await began_on_a(router)
    events = events_of(answer)  # ...so the stream ends with the first break's error
    errors = errors_in(events)
    assert len(errors) == 1 and errors[0]["error"]["code"] == "upstream_failed", answer
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1, answer
    assert b"127.0.0.1" not in answer and b"\x00" not in answer
    metrics = await scrape(router)
    assert value(metrics, "globalpool_stream_failovers_total", outcome="failed") >= 1


async def test_a_continuation_refused_with_500_moves_to_the_next_worker(
        start_router: StartRouter, sim_urls: SimURLs) -> None:
    a, b, c = await sim_urls(3)
    await faults(a, mid_stream_error_rate=1.0)
    await faults(b, error_rate=1.0)
    router = await start_router(a, b, c)
    for path, body, kind in ((CHAT_PATH, CHAT, "chat"),
                             ("/v1/completions", COMPLETION, "completions")):
        assert_one_whole_stream(await began_on_a(router, body, path), kind)


async def test_a_client_gone_during_the_continuation_stops_its_engine(
        start_router: StartRouter, sim_urls: SimURLs) -> None:
    a, b = await sim_urls(2)
    await faults(a, mid_stream_error_rate=1.0)
    await faults(b, slow_factor=40.0)  # ~40 ms a token
    router = await start_router(a, b)
    async with aiohttp.ClientSession() as session:
        response = await session.post(f"{router}{CHAT_PATH}", json={**CHAT, "max_tokens": 1000})
        received = b""
        deadline = time.monotonic() + 10
        while token_events(received) < 6:  # a sends at most 3: these are b's too
            assert time.monotonic() < deadline, received
            received += await within(response.content.readany(), 5)
        assert await sim_running(b) == 1
        response.close()
    deadline = time.monotonic() + 3
    while await sim_running(b) != 0:
        assert time.monotonic() < deadline, "the continuation kept generating for no one"
        await asyncio.sleep(0.05)


async def test_the_opt_out_header_is_case_insensitive(
        start_router: StartRouter, sim_urls: SimURLs) -> None:
    a, b = await sim_urls(2)
    await faults(a, mid_stream_error_rate=1.0)
    answer = await began_on_a(await start_router(a, b),
                              headers={"X-Globalpool-Failover": "OFF"})
    assert errors_in(events_of(answer)), answer
    assert await arrivals(b) == 0
