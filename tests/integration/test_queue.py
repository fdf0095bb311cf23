"""Requests wait at the router while every worker is busy (router.admission.queue): real
router apps, a real simulator, a real Valkey."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

import aiohttp
import pytest

from router.app import PROXY
from tests.integration.operators_fleet import CHAT, OpsFleet, fleet_config

pytestmark = pytest.mark.integration

SLOTS = 8  # the heartbeats' max_num_seqs: room for SLOTS + 1 (ENGINE_QUEUE) at once



async def stream(url: str, max_tokens: int, *, traffic_class: str = "interactive"
                 ) -> dict[str, Any]:
    """One streamed chat request: status, seconds to the first byte, server-timing."""
    started = time.monotonic()
    async with aiohttp.ClientSession() as session, session.post(
        f"{url}/v1/chat/completions",
        json={**CHAT, "stream": True, "max_tokens": max_tokens, "ignore_eos": True},
        headers={"x-globalpool-class": traffic_class},
    ) as response:
        first_s = time.monotonic() - started
        body = await response.read()
        timing = response.headers.get("server-timing", "")
        return {"status": response.status, "first_s": first_s, "body": body,
                "queue_s": _queue_s(timing)}


async def scrape(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as response:
        return await response.text()


def _queue_s(timing: str) -> float:
    for part in timing.split(","):
        name, _, duration = part.strip().partition(";dur=")
        if name == "queue":
            return float(duration) / 1000.0
    return 0.0


async def start(fleet: OpsFleet, redis_url: str, key_prefix: str,
                **queue: Any) -> str:
    config: Mapping[str, Any] = fleet_config(redis_url, key_prefix, queue=queue)
    await fleet.start({"a": "us-east"}, config=config, decode_step_ms=40.0)
    return fleet.url


async def fill(url: str, count: int, max_tokens: int) -> list[asyncio.Task[dict[str, Any]]]:
    tasks = [asyncio.create_task(stream(url, max_tokens)) for _ in range(count)]
    await asyncio.sleep(0.3)  # all dispatched, none finished
    return tasks


async def test_requests_beyond_the_workers_room_wait_and_all_complete(
        fleet: OpsFleet, redis_url: str, key_prefix: str) -> None:
    url = await start(fleet, redis_url, key_prefix)
    results = await asyncio.gather(*(stream(url, 15) for _ in range(SLOTS + 4)))
    assert [r["status"] for r in results] == [200] * (SLOTS + 4)
    assert all(r["body"].rstrip().endswith(b"data: [DONE]") for r in results)
    waited = sorted(r["queue_s"] for r in results)
    # SLOTS + 1 went at once; 3 waited until the first ones finished (15 steps of 40 ms).
    assert waited[: SLOTS + 1] == [0.0] * (SLOTS + 1)
    assert all(w > 0.3 for w in waited[SLOTS + 1:]), waited
    metrics = await scrape(url)
    assert 'globalpool_queue_exits_total{outcome="room"} 3.0' in metrics
    assert "globalpool_queued_requests 0.0" in metrics


async def test_interactive_requests_go_before_batch_ones_that_arrived_earlier(
        fleet: OpsFleet, redis_url: str, key_prefix: str) -> None:
    url = await start(fleet, redis_url, key_prefix)
    long = await fill(url, SLOTS, 80)  # ~3.2 s each
    short = await fill(url, 1, 10)  # frees its place after ~0.4 s
    batch = asyncio.create_task(stream(url, 5, traffic_class="batch"))
    await asyncio.sleep(0.05)
    interactive = await stream(url, 60)  # holds the freed place for ~2.4 s
    batch_result = await batch
    assert interactive["status"] == batch_result["status"] == 200
    # The interactive request took the place the short stream freed; the batch request,
    # although it came first, waited for one of the long streams to end.
    assert interactive["queue_s"] < 1.5 < batch_result["queue_s"], (interactive, batch_result)
    await asyncio.gather(*long, *short)


async def test_a_full_queue_refuses_with_503_and_a_wait_ends_at_its_deadline(
        fleet: OpsFleet, redis_url: str, key_prefix: str) -> None:
    url = await start(fleet, redis_url, key_prefix, max_requests=1, max_wait_ms=600)
    busy = await fill(url, SLOTS + 1, 60)  # ~2.4 s each
    waiting = asyncio.create_task(stream(url, 5))
    await asyncio.sleep(0.1)
    async with aiohttp.ClientSession() as session, session.post(
            f"{url}/v1/chat/completions", json=CHAT) as response:
        refused = await response.json()
        assert response.status == 503 and response.headers["Retry-After"] == "1"
    assert refused["error"]["code"] == "queue_full"
    # The waiting one went to the (busy) worker at its deadline, and was served there.
    result = await waiting
    assert result["status"] == 200 and 0.5 < result["queue_s"] < 1.5
    await asyncio.gather(*busy)
    metrics = await scrape(url)
    assert 'globalpool_queue_exits_total{outcome="deadline"} 1.0' in metrics
    assert 'globalpool_queue_exits_total{outcome="full"} 1.0' in metrics


async def test_a_client_that_leaves_while_waiting_is_never_sent(
        fleet: OpsFleet, redis_url: str, key_prefix: str) -> None:
    url = await start(fleet, redis_url, key_prefix)
    busy = await fill(url, SLOTS + 1, 25)  # ~1 s each
    leaving = asyncio.create_task(stream(url, 5))
    await asyncio.sleep(0.2)
    leaving.cancel()
    await asyncio.gather(leaving, return_exceptions=True)
    await asyncio.gather(*busy)
    await asyncio.sleep(0.3)
    # The worker had room again well before now: had the request stayed in the queue it
    # would have been dispatched (or expired) by now.
    queue = fleet.apps[0][PROXY].queue
    assert queue is not None and len(queue.backlog) == 0
    assert (queue.backlog.dispatched, queue.backlog.expired) == (0, 0)
