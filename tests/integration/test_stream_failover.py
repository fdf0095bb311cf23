"""Mid-stream failover: a stream whose worker dies is finished on another, as one stream.

Real simulators and a real router on loopback (the fleet of test_proxy). Worker `a` cuts
every stream after 1-3 tokens (`mid_stream_error_rate`) or plays a misbehaviour; worker
`b` is healthy. The client must see what one healthy worker would have sent: one `id`,
`created` and `model`, choice index 0, one role event, the full token count, one finish
reason, one usage chunk covering the whole answer, one `[DONE]`, no error.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import aiohttp
import openai
import pytest

from tests.integration.operators_fleet import scrape, value
from tests.integration.test_proxy import FleetFactory, fleet_factory

__all__ = ["fleet_factory"]
pytestmark = pytest.mark.integration

TOKENS = 12
CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "Tell a story"}],
                        "max_tokens": TOKENS, "stream": True, "ignore_eos": True,
                        "stream_options": {"include_usage": True}}
COMPLETION: dict[str, Any] = {"model": "m", "prompt": "Once upon a time", "max_tokens": TOKENS,
                              "stream": True, "ignore_eos": True,
                              "stream_options": {"include_usage": True}}


def events_of(body: bytes) -> list[Any]:
    """The stream's data payloads, decoded (`[DONE]` kept as the string)."""
    payloads: list[Any] = []
    for event in body.decode().split("\n\n"):
        data = "\n".join(line[5:].strip() for line in event.splitlines()
                         if line.startswith("data:"))
        if data:
            payloads.append(data if data == "[DONE]" else json.loads(data))
    return payloads


def assert_one_whole_stream(body: bytes, kind: str, tokens: int = TOKENS) -> str:
    """What a healthy worker would have sent; returns the answer's text."""
    events = events_of(body)
    assert events and events[-1] == "[DONE]" and events.count("[DONE]") == 1, body
    chunks = events[:-1]
    assert not [c for c in chunks if "error" in c], body
    assert len({c["id"] for c in chunks}) == 1, body
    assert len({c["created"] for c in chunks}) == 1 and {c["model"] for c in chunks} == {"m"}
    choices = [choice for c in chunks for choice in c["choices"]]
    assert {choice["index"] for choice in choices} == {0}
    finishes = [choice["finish_reason"] for choice in choices if choice["finish_reason"]]
    assert finishes == ["length"], body
    if kind == "chat":
        assert sum("role" in choice["delta"] for choice in choices) == 1, body
        texts = [choice["delta"].get("content") or "" for choice in choices]
    else:
        texts = [choice.get("text") or "" for choice in choices]
    assert sum(1 for text in texts if text) == tokens, body
    usages = [c["usage"] for c in chunks if c.get("usage") and not c["choices"]]
    assert len(usages) == 1, body
    usage = usages[0]
    assert usage["completion_tokens"] == tokens
    assert usage["total_tokens"] == usage["prompt_tokens"] + tokens
    return "".join(texts)


async def _stream(url: str, path: str, body: dict[str, Any],
                  headers: dict[str, str] | None = None) -> tuple[int, str, bytes]:
    async with aiohttp.ClientSession() as session, session.post(
            f"{url}{path}", json=body, headers=headers or {}) as response:
        return response.status, response.headers.get("x-globalpool-worker", ""), \
            await response.read()


async def _streams_that_began_on_a(url: str, path: str, body: dict[str, Any],
                                   headers: dict[str, str] | None = None,
                                   wanted: int = 2) -> list[bytes]:
    """Streams the router started on `a` (round robin: every other one, until `a` is
    ejected)."""
    began: list[bytes] = []
    for _ in range(12):
        status, worker, answer = await _stream(url, path, body, headers)
        assert status == 200, answer
        if worker == "a":
            began.append(answer)
            if len(began) == wanted:
                break
    assert began, "no stream was sent to a"
    return began


@pytest.mark.parametrize(("path", "body", "kind"), [
    ("/v1/chat/completions", CHAT, "chat"), ("/v1/completions", COMPLETION, "completions")])
async def test_a_stream_whose_worker_dies_is_finished_on_another(
        fleet_factory: FleetFactory, path: str, body: dict[str, Any], kind: str) -> None:
    fleet = await fleet_factory({"a": "us-east", "b": "us-east"}, policy="round_robin")
    await fleet.faults("a", mid_stream_error_rate=1.0)
    for answer in await _streams_that_began_on_a(fleet.router_url, path, body):
        assert_one_whole_stream(answer, kind)
    metrics = await scrape(fleet.router_url)
    assert value(metrics, "globalpool_stream_failovers_total",
                 outcome="continued", reason="") >= 1


async def test_the_openai_client_reads_one_uninterrupted_stream(
        fleet_factory: FleetFactory) -> None:
    fleet = await fleet_factory({"a": "us-east", "b": "us-east"}, policy="round_robin")
    await fleet.faults("a", mid_stream_error_rate=1.0)
    client = openai.AsyncOpenAI(base_url=f"{fleet.router_url}/v1", api_key="x", max_retries=0)
    try:
        for _ in range(4):
            stream = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=TOKENS,
                stream=True, extra_body={"ignore_eos": True})
            pieces = [chunk.choices[0].delta.content or "" async for chunk in stream
                      if chunk.choices]
            assert sum(1 for piece in pieces if piece) == TOKENS
    finally:
        await client.close()


async def test_a_stream_that_never_ends_is_cut_at_its_max_tokens_and_finished(
        fleet_factory: FleetFactory) -> None:
    # The worker streams the same token forever: past what max_tokens allows it is cut
    # off as broken; the client already has every token it asked for, so the stream is
    # ended there (finish_reason "length", [DONE]) without asking another worker.
    fleet = await fleet_factory({"a": "us-east", "b": "us-east"}, policy="round_robin")
    await fleet.faults("a", misbehave="endless_body")
    body = {**CHAT, "stream_options": None}
    for answer in await _streams_that_began_on_a(fleet.router_url, "/v1/chat/completions",
                                                 body):
        events = events_of(answer)
        assert events[-1] == "[DONE]" and not [e for e in events if "error" in e], answer
        finishes = [c["finish_reason"] for e in events[:-1] for c in e["choices"]
                    if c["finish_reason"]]
        assert finishes == ["length"]
    metrics = await scrape(fleet.router_url)
    assert value(metrics, "globalpool_stream_failovers_total",
                 outcome="finished", reason="") >= 1


async def test_a_client_can_opt_out_with_a_header(fleet_factory: FleetFactory) -> None:
    fleet = await fleet_factory({"a": "us-east", "b": "us-east"}, policy="round_robin")
    await fleet.faults("a", mid_stream_error_rate=1.0)
    for answer in await _streams_that_began_on_a(
            fleet.router_url, "/v1/chat/completions", CHAT, {"x-globalpool-failover": "off"}):
        events = events_of(answer)
        assert [e for e in events if "error" in e], answer  # ends as without failover
        assert events[-1] == "[DONE]"


async def test_an_operator_can_switch_it_off_for_a_model(fleet_factory: FleetFactory) -> None:
    fleet = await fleet_factory({"a": "us-east", "b": "us-east"}, policy="round_robin",
                                router={"stream_failover": {"disabled_models": ["m"]}})
    await fleet.faults("a", mid_stream_error_rate=1.0)
    for answer in await _streams_that_began_on_a(fleet.router_url, "/v1/chat/completions",
                                                 CHAT):
        assert [e for e in events_of(answer) if "error" in e], answer


async def test_a_stream_with_logprobs_is_not_continued_and_says_why(
        fleet_factory: FleetFactory) -> None:
    fleet = await fleet_factory({"a": "us-east", "b": "us-east"}, policy="round_robin")
    await fleet.faults("a", mid_stream_error_rate=1.0)
    for answer in await _streams_that_began_on_a(fleet.router_url, "/v1/chat/completions",
                                                 {**CHAT, "logprobs": True}):
        errors = [e for e in events_of(answer) if "error" in e]
        assert errors and errors[0]["error"]["code"] == "upstream_failed", answer
        assert b"127." not in answer  # no worker address in what the client sees
    metrics = await scrape(fleet.router_url)
    assert value(metrics, "globalpool_stream_failovers_total",
                 outcome="not_continued", reason="logprobs") >= 1


async def test_with_no_other_worker_the_stream_ends_with_an_error_event(
        fleet_factory: FleetFactory) -> None:
    fleet = await fleet_factory({"a": "us-east"})
    await fleet.faults("a", mid_stream_error_rate=1.0)
    status, _, answer = await _stream(fleet.router_url, "/v1/chat/completions", CHAT)
    assert status == 200
    events = events_of(answer)
    assert [e for e in events if "error" in e] and events[-1] == "[DONE]", answer
    metrics = await scrape(fleet.router_url)
    assert value(metrics, "globalpool_stream_failovers_total",
                 outcome="failed", reason="") >= 1


async def _raw_stream(url: str, path: str, body: dict[str, Any]) -> bytes:
    """The whole HTTP answer as it came on the socket (framing and trailers too)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    payload = json.dumps(body).encode()
    writer.write(f"POST {path} HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
                 + payload)
    try:
        async with asyncio.timeout(10):
            return await reader.read(-1)
    finally:
        writer.close()


async def test_a_continued_stream_ends_with_a_server_timing_trailer(
        fleet_factory: FleetFactory) -> None:
    fleet = await fleet_factory({"a": "us-east", "b": "us-east"}, policy="round_robin")
    await fleet.faults("a", mid_stream_error_rate=1.0)
    answers = [await _raw_stream(fleet.router_url, "/v1/chat/completions", CHAT)
               for _ in range(4)]
    began_on_a = [a for a in answers if b"\r\nx-globalpool-worker: a\r\n" in a.lower()]
    assert began_on_a, answers
    for answer in began_on_a:
        trailer = re.search(rb'\r\n0\r\nserver-timing: continuation;dur=([0-9.]+);desc="1"'
                            rb"\r\n\r\n$", answer)
        assert trailer is not None, answer[-300:]
    untouched = [a for a in answers if a not in began_on_a]
    assert all(a.endswith(b"\r\n0\r\n\r\n") for a in untouched)
