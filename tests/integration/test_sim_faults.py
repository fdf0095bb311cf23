"""Fault knobs of the simulator, set through its /sim/faults endpoint on loopback."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from tests.integration.conftest import StartSim
from worker.sim.server import SimServer

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
            "slow_factor": 2.0,
            "busy_in_stream": False,
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


async def test_hung_requests_do_not_hold_up_shutdown(start_sim: StartSim) -> None:
    sim = await start_sim()
    async with aiohttp.ClientSession() as http:
        await set_faults(http, sim, hang=True)
        pending = asyncio.create_task(chat_status(http, sim))
        await asyncio.sleep(0.05)
        started = time.monotonic()
        await sim.stop()
        assert time.monotonic() - started < 1.0
        with pytest.raises(aiohttp.ClientError):
            await pending


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
