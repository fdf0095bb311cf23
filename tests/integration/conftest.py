"""Fixtures for tests that run the simulator in-process on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest

from lab.sim.config import SimConfig
from lab.sim.server import SimServer

# Fast engine timings: tests measure behaviour, not speed.
FAST = {"decode_step_ms": 1.0, "decode_step_ms_per_seq": 0.0, "prefill_tokens_per_s": 1e6}
StartSim = Callable[..., Awaitable[SimServer]]

if TYPE_CHECKING:
    from tests.integration.operators_fleet import OpsFleet


@pytest.fixture
async def start_sim() -> AsyncIterator[StartSim]:
    """Start simulators (FAST timings unless overridden); all are stopped afterwards."""
    servers: list[SimServer] = []

    async def start(**changes: Any) -> SimServer:
        server = SimServer(SimConfig(**{**FAST, **changes}))
        await server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        await server.stop()


@pytest.fixture
async def sim(start_sim: StartSim) -> SimServer:
    """One simulator with FAST timings."""
    return await start_sim()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def fleet(redis_url: str, key_prefix: str, tmp_path: Path, start_sim: StartSim,
                monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[OpsFleet]:
    """Router apps in front of simulators (tests.integration.operators_fleet), with the
    admin token set; `await fleet.start(...)` starts them, they stop afterwards."""
    from tests.integration.operators_fleet import TOKEN, OpsFleet  # it imports this module

    monkeypatch.setenv("GLOBALPOOL_ADMIN_TOKEN", TOKEN)
    fleet = OpsFleet(redis_url, key_prefix, tmp_path, start_sim)
    yield fleet
    await fleet.close()
