"""A worker that dies leaves the pool within its TTL, and no request sent afterwards fails."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from collections.abc import Iterator

import aiohttp
import pytest

from tests.integration.stack import RunningUp, pid_alive, small_config, start_up

pytestmark = pytest.mark.integration

BODY = {"model": "tiny-llama", "max_tokens": 4,
        "messages": [{"role": "user", "content": "ping"}]}
FROM_US_EAST = {"x-globalpool-client-region": "us-east"}


@pytest.fixture
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningUp]:
    tmp_path = tmp_path_factory.mktemp("loss")
    running = start_up(tmp_path, small_config(tmp_path))
    try:
        yield running
    finally:
        assert running.stop() == 0, running.output()
        assert [pid for pid in running.all_pids() if pid_alive(pid)] == []


async def _send(session: aiohttp.ClientSession, url: str, stream: bool = False) -> tuple[int, str]:
    async with session.post(f"{url}/v1/chat/completions", json={**BODY, "stream": stream},
                            headers=FROM_US_EAST) as response:
        await response.read()
        return response.status, response.headers.get("x-globalpool-worker", "")


async def _burst(url: str, count: int, concurrency: int = 6) -> list[tuple[int, str]]:
    limit = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as session:
        async def one(index: int) -> tuple[int, str]:
            async with limit:
                return await _send(session, url, stream=index % 2 == 0)
        return await asyncio.gather(*(one(i) for i in range(count)))


def _pid(up: RunningUp, name: str) -> int:
    return next(int(c["pid"]) for c in up.children() if c["name"] == name)


async def test_killed_engine_and_killed_agent_leave_the_pool(up: RunningUp) -> None:
    before = await _burst(up.url, 24)
    assert all(status == 200 for status, _ in before)
    assert {worker for _, worker in before} == {"us-east-1", "us-east-2"}

    # SIGKILL the engine of us-east-1: requests right after the kill may reach it, fail to
    # connect, and must be retried elsewhere; none may fail.
    os.kill(_pid(up, "sim-us-east-1"), signal.SIGKILL)
    killed_at = time.monotonic()
    right_after = await _burst(up.url, 40)
    assert [s for s, _ in right_after if s != 200] == []

    # SIGKILL the agent of us-east-2: its engine still serves, but its heartbeat expires.
    os.kill(_pid(up, "worker-us-east-2"), signal.SIGKILL)
    await asyncio.sleep(1.0 + 0.4)  # the TTL in small_config, plus one collector tick
    assert time.monotonic() - killed_at < 5
    later = await _burst(up.url, 30)
    assert [s for s, _ in later if s != 200] == []
    served = Counter(worker for _, worker in later)
    assert "us-east-1" not in served and "us-east-2" not in served, served
    assert all(worker.startswith("eu-west-") for worker in served), served
