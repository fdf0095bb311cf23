"""Prompts sent ahead and not yet prefilled count in where the next request goes, on real
processes: a router app, a real Valkey, two simulators (router.policy.predicted_ttft)."""

from __future__ import annotations

import asyncio
from collections import Counter

import aiohttp

from router.app import PROXY
from router.proxy.replies import WORKER_HEADER
from tests.integration.operators_fleet import OpsFleet, wait_for
from worker.schema import Performance

LONG_PROMPT_CHARS = 8_000  # ~2,000 tokens: 0.5 s of prefill at the simulators' 4,000/s


async def test_a_burst_of_long_prompts_is_shared_out_by_the_prefill_it_puts_ahead(
        fleet: OpsFleet) -> None:
    """Eight long prompts sent at once to two idle 8-slot workers, w2's engine step said
    to be 10 ms slower. Their heartbeats stay idle and no slot fills, so neither load nor
    queue tells the workers apart: without the prefill this router already sent each one,
    all eight go to w1, one after the other into the same engine steps. They go 4 and 4,
    and once the answers have come nothing is left counted."""
    await fleet.start({"w1": "us-east", "w2": "us-east"}, prefill_tokens_per_s=4_000.0)
    await fleet.publish("w2", performance=Performance(itl_ms=35.0))
    await fleet.publish("w1", performance=Performance(itl_ms=25.0))
    proxy = fleet.apps[0][PROXY]
    await wait_for(lambda: proxy.holder.current.workers["w2"].itl_ms == 35.0)

    async with aiohttp.ClientSession() as session:
        for _ in range(2):
            served = Counter(await asyncio.gather(*(
                ask(session, fleet.url, n, LONG_PROMPT_CHARS) for n in range(8))))
            assert served == {"w1": 4, "w2": 4}, served
            await wait_for(lambda: not proxy.inflight.prefilling)


async def test_a_peer_replicas_prompts_not_yet_prefilled_count_too(fleet: OpsFleet) -> None:
    """Replica A sends a long prompt to w1 (the faster step); while w1 prefills it
    (2,000 tokens at 1,000/s), replica B, which learns of it only from A's report, sends
    its next request to w2. Then the prompt's first byte comes and A's next report
    takes it back: B goes to w1 again."""
    await fleet.start({"w1": "us-east", "w2": "us-east"}, replicas=2,
                      prefill_tokens_per_s=1_000.0)
    await fleet.publish("w2", performance=Performance(itl_ms=35.0))
    await fleet.publish("w1", performance=Performance(itl_ms=25.0))
    a, b = (app[PROXY] for app in fleet.apps)
    for proxy in (a, b):
        await wait_for(lambda p=proxy: p.holder.current.workers["w2"].itl_ms == 35.0)
    async with aiohttp.ClientSession() as session:
        long_one = asyncio.create_task(ask(session, fleet.urls[0], 0, LONG_PROMPT_CHARS))
        await wait_for(lambda: b.inflight.prefilling.get("w1", 0) > 1000)
        assert await ask(session, fleet.urls[1], 1, 100) == "w2"
        assert await long_one == "w1"
        await wait_for(lambda: not b.inflight.prefilling)
        assert await ask(session, fleet.urls[1], 2, 100) == "w1"


async def ask(session: aiohttp.ClientSession, url: str, number: int, chars: int) -> str:
    """A streamed chat request of about `chars` / 4 prompt tokens; the worker it went to."""
    body = {"model": "m", "stream": True, "max_tokens": 2, "messages": [
        {"role": "user", "content": f"{number} " + "x" * chars}]}
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        assert response.status == 200, await response.text()
        await response.read()
        return response.headers[WORKER_HEADER]
