"""Hedged first tokens: a late stream is sent again elsewhere, the first to answer kept.

Real simulators and a real router on loopback (the fleet of test_proxy): worker `a` is in
the router's region (us-east) and preferred, `b` 80 ms away in eu-west. A wedged or slow
`a` (a GPU stuck in a long prefill) is what hedging is for: the client must get its first
token from `b` soon, one whole stream, and `a` must stop working on the copy it lost.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import openai
import pytest

from tests.integration.operators_fleet import scrape, value
from tests.integration.test_proxy import FleetFactory, fleet_factory
from tests.integration.test_stream_failover import assert_one_whole_stream

__all__ = ["fleet_factory"]
pytestmark = pytest.mark.integration

TOKENS = 6
CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "Hello"}],
                        "max_tokens": TOKENS, "stream": True, "ignore_eos": True,
                        "stream_options": {"include_usage": True}}
HEDGE = {"x-globalpool-hedge": "on"}
# The simulator's first token comes ~1.1 ms x slow_factor after the request (its prefill
# step), each further one 10 ms x slow_factor later. SLOW: `a` stuck in a long prefill, its
# first token after ~1.1 s, the next ones 10 s apart.
SLOW = {"slow_factor": 1000.0}
ONE = {**CHAT, "max_tokens": 1}  # for a slow worker that answers: its first token is all


class Answer:
    def __init__(self, response: aiohttp.ClientResponse, body: bytes, ttft_s: float) -> None:
        self.status = response.status
        self.headers = response.headers
        self.body = body
        self.ttft_s = ttft_s

    @property
    def worker(self) -> str:
        return self.headers.get("x-globalpool-worker", "")


async def stream(url: str, headers: dict[str, str] | None = None,
                 body: dict[str, Any] | None = None) -> Answer:
    async with aiohttp.ClientSession() as session:
        sent = time.monotonic()
        async with session.post(f"{url}/v1/chat/completions", json=body or CHAT,
                                headers=headers or {}) as response:
            first = await response.content.readany()
            ttft_s = time.monotonic() - sent
            return Answer(response, first + await response.read(), ttft_s)


async def running_drops_to_zero(fleet: Any, worker_id: str, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if await fleet.running(worker_id) == 0:
            return True
        await asyncio.sleep(0.05)
    return False


async def test_a_late_first_token_is_hedged_to_the_next_region_and_the_loser_aborted(
        fleet_factory: FleetFactory) -> None:
    fleet = await fleet_factory({"a": "us-east", "b": "eu-west"})
    await fleet.faults("a", **SLOW)
    answer = await stream(fleet.router_url, HEDGE)
    assert answer.status == 200
    assert answer.worker == "b" and answer.headers["x-globalpool-route"] == "hedge"
    assert answer.headers["x-globalpool-region"] == "eu-west"
    assert answer.ttft_s < 0.6, answer.ttft_s  # not a's ~1.1 s
    assert_one_whole_stream(answer.body, "chat", TOKENS)
    timing = answer.headers["server-timing"]
    assert 'hedge;dur=' in timing and 'desc="copy"' in timing, timing
    # The copy a lost was closed: the engine aborted it (else it runs ~7 s).
    assert await running_drops_to_zero(fleet, "a", 1.0)
    metrics = await scrape(fleet.router_url)
    assert value(metrics, "globalpool_hedges_total", outcome="won", region="eu-west") == 1
    assert value(metrics, "globalpool_routing_decisions_total", reason="hedge") == 1
    assert value(metrics, "globalpool_hedges_refunded_total") == 1  # it answered: refunded
    # What the lost copy waited is learnt as at least its TTFT: us-east is now penalised
    # (else copies that always lose would hide a slow region from the router for good).
    assert value(metrics, "globalpool_region_latency_penalty_ms", region="us-east") > 0


async def test_a_first_token_in_time_sends_no_copy(fleet_factory: FleetFactory) -> None:
    fleet = await fleet_factory({"a": "us-east", "b": "eu-west"})
    for _ in range(5):
        answer = await stream(fleet.router_url, HEDGE)
        assert answer.worker == "a" and answer.headers["x-globalpool-route"] != "hedge"
        assert_one_whole_stream(answer.body, "chat", TOKENS)
        assert "hedge" not in answer.headers["server-timing"]
    metrics = await scrape(fleet.router_url)
    assert value(metrics, "globalpool_hedges_total") == 0
    assert await fleet.running("b") == 0


async def test_a_copy_goes_over_a_connection_opened_ahead(fleet_factory: FleetFactory) -> None:
    """Hedged streams keep a connection open ahead to where their copies would go: `b`
    serves nothing while `a` is fast, yet when `a` turns slow the copy finds a connection
    to `b` open (in another region a new one costs a round trip more, and TLS more)."""
    fleet = await fleet_factory({"a": "us-east", "b": "eu-west"})
    answer = await stream(fleet.router_url, HEDGE)
    assert answer.worker == "a" and "hedge" not in answer.headers["server-timing"]
    metrics = await scrape(fleet.router_url)
    assert value(metrics, "globalpool_upstream_connections_warmed_total") == 1
    opened = value(metrics, "globalpool_upstream_connections_opened_total")
    assert opened == 2  # a's, and the one to b opened ahead
    assert await fleet.running("b") == 0
    await fleet.faults("a", **SLOW)
    answer = await stream(fleet.router_url, HEDGE)
    assert answer.worker == "b" and answer.headers["x-globalpool-route"] == "hedge"
    assert_one_whole_stream(answer.body, "chat", TOKENS)
    metrics = await scrape(fleet.router_url)
    assert value(metrics, "globalpool_upstream_connections_opened_total") == opened


async def test_nothing_is_hedged_unless_asked(fleet_factory: FleetFactory) -> None:
    fleet = await fleet_factory({"a": "us-east", "b": "eu-west"})
    await fleet.faults("a", slow_factor=300.0)  # first token ~0.33 s
    answer = await stream(fleet.router_url, body=ONE)
    assert answer.worker == "a" and answer.ttft_s > 0.25
    assert_one_whole_stream(answer.body, "chat", 1)
    assert value(await scrape(fleet.router_url), "globalpool_hedges_total") == 0


async def test_a_class_hedged_by_config_and_a_client_that_opts_out(
        fleet_factory: FleetFactory) -> None:
    fleet = await fleet_factory({"a": "us-east", "b": "eu-west"},
                                router={"hedging": {"classes": ["interactive"]}})
    await fleet.faults("a", **SLOW)
    hedged = await stream(fleet.router_url)
    assert hedged.worker == "b" and hedged.headers["x-globalpool-route"] == "hedge"
    batch = await stream(fleet.router_url, {"x-globalpool-class": "batch"}, ONE)
    assert batch.headers["x-globalpool-route"] != "hedge"
    kept = await stream(fleet.router_url, {"x-globalpool-hedge": "off"}, ONE)
    # (Either may go to `b` at once: the copy `a` lost taught the router that its first
    # tokens come late there.)
    assert kept.headers["x-globalpool-route"] != "hedge"
    assert value(await scrape(fleet.router_url), "globalpool_hedges_total") == 1


async def test_the_budget_caps_the_share_of_streams_hedged_in_vain(
        fleet_factory: FleetFactory) -> None:
    fleet = await fleet_factory({"a": "us-east", "b": "eu-west"},
                                router={"hedging": {"max_fraction": 0.25}})
    await fleet.faults("a", slow_factor=400.0)  # first token ~0.45 s
    await fleet.faults("b", slow_factor=1200.0)  # ~1.3 s: every copy loses, none refunded
    answers = await asyncio.gather(*(stream(fleet.router_url, HEDGE, ONE) for _ in range(8)))
    assert all(answer.status == 200 and answer.worker == "a" for answer in answers)
    metrics = await scrape(fleet.router_url)
    copies = value(metrics, "globalpool_hedges_total", outcome="lost", region="eu-west")
    # One token to start, then a quarter per stream: at most 1 + 8 / 4 copies.
    assert 1 <= copies <= 3, copies
    assert value(metrics, "globalpool_hedges_total") == copies
    assert value(metrics, "globalpool_hedges_denied_total") == 8 - copies
    assert value(metrics, "globalpool_hedges_refunded_total") == 0


async def test_a_copy_that_fails_leaves_the_original_to_answer(
        fleet_factory: FleetFactory) -> None:
    fleet = await fleet_factory({"a": "us-east", "b": "eu-west"})
    await fleet.faults("a", slow_factor=300.0)
    await fleet.faults("b", error_rate=1.0)
    answer = await stream(fleet.router_url, HEDGE, ONE)
    assert answer.status == 200 and answer.worker == "a"
    assert_one_whole_stream(answer.body, "chat", 1)
    timing = answer.headers["server-timing"]
    assert 'desc="original"' in timing, timing
    metrics = await scrape(fleet.router_url)
    assert value(metrics, "globalpool_hedges_total", outcome="failed") == 1
    assert value(metrics, "globalpool_attempt_failures_total", region="eu-west") == 1


async def test_when_the_original_fails_the_copy_answers(fleet_factory: FleetFactory) -> None:
    # `a` hangs: its first byte never comes (first_byte_s 2 s); the copy answers at once.
    fleet = await fleet_factory({"a": "us-east", "b": "eu-west"})
    await fleet.faults("a", hang=True)
    answer = await stream(fleet.router_url, HEDGE)
    assert answer.status == 200 and answer.worker == "b" and answer.ttft_s < 1.0
    assert_one_whole_stream(answer.body, "chat", TOKENS)


async def test_a_client_that_leaves_during_the_race_stops_both_engines(
        fleet_factory: FleetFactory) -> None:
    fleet = await fleet_factory({"a": "us-east", "b": "eu-west"})
    await fleet.faults("a", **SLOW)
    await fleet.faults("b", **SLOW)
    async with aiohttp.ClientSession() as session:
        request = asyncio.create_task(session.post(f"{fleet.router_url}/v1/chat/completions",
                                                   json=CHAT, headers=HEDGE))
        deadline = time.monotonic() + 2.0
        while await fleet.running("b") == 0:  # the copy went out
            assert time.monotonic() < deadline, "no copy was sent"
            await asyncio.sleep(0.02)
        request.cancel()
        await asyncio.gather(request, return_exceptions=True)
    assert await running_drops_to_zero(fleet, "a", 1.0)
    assert await running_drops_to_zero(fleet, "b", 1.0)
    metrics = await scrape(fleet.router_url)
    assert value(metrics, "globalpool_client_disconnects_total") == 1
    assert value(metrics, "globalpool_hedges_total", outcome="lost") == 1


async def test_the_openai_client_reads_a_hedged_stream(fleet_factory: FleetFactory) -> None:
    fleet = await fleet_factory({"a": "us-east", "b": "eu-west"})
    await fleet.faults("a", **SLOW)
    client = openai.AsyncOpenAI(base_url=f"{fleet.router_url}/v1", api_key="x", max_retries=0)
    try:
        chunks = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=TOKENS,
            stream=True, extra_body={"ignore_eos": True}, extra_headers=HEDGE)
        pieces = [chunk.choices[0].delta.content or "" async for chunk in chunks
                  if chunk.choices]
        assert sum(1 for piece in pieces if piece) == TOKENS
    finally:
        await client.close()


@pytest.mark.parametrize("misbehave", ["headers_then_hang", "half_body_close", "garbage",
                                       "reset_mid_stream"])
async def test_a_lying_worker_leaves_the_stream_whole(fleet_factory: FleetFactory,
                                                      misbehave: str) -> None:
    # `a` answers wrongly while its engine looks healthy: the head then nothing, half the
    # first event then FIN, bytes that are not HTTP, or a reset after 3 tokens. Before a
    # first event, whether the copy outran it or it failed first (then a plain retry),
    # the client gets `b`'s stream and no byte of `a`'s; after `a`'s first tokens, the
    # stream is continued on `b` (mid-stream failover). Either way one whole stream.
    fleet = await fleet_factory({"a": "us-east", "b": "eu-west"})
    await fleet.faults("a", misbehave=misbehave)
    answer = await stream(fleet.router_url, HEDGE)
    assert answer.status == 200, answer.body
    if misbehave == "reset_mid_stream":
        assert answer.worker == "a"  # (the headers went out with a's first token)
    else:
        assert answer.worker == "b" and answer.headers["x-globalpool-route"] in (
            "hedge", "retry"), answer.headers
    assert_one_whole_stream(answer.body, "chat", TOKENS)
