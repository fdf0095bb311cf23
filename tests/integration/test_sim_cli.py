"""The simulator as a process: the launcher's contract (listening line, signals, crash)."""

from __future__ import annotations

import asyncio
import re
import signal
import sys
from collections.abc import AsyncIterator

import aiohttp
import pytest

from tests.conftest import ROOT, within

pytestmark = pytest.mark.integration

LAUNCH = (
    "import argparse, sys\n"
    "from lab.sim.cli import add_sim_arguments, run_sim\n"
    "p = argparse.ArgumentParser()\n"
    "add_sim_arguments(p)\n"
    "sys.exit(run_sim(p.parse_args()))\n"
)


class SimProcess:
    def __init__(self, process: asyncio.subprocess.Process, url: str) -> None:
        self.process = process
        self.url = url


async def spawn(*flags: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-c", LAUNCH, *flags,
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip


@pytest.fixture
async def sim_process() -> AsyncIterator[SimProcess]:
    process = await spawn("--port", "0", "--served-model-name", "m1", "m2", "--seed", "3")
    assert process.stdout is not None
    async with asyncio.timeout(15):
        line = await process.stdout.readline()
    match = re.fullmatch(rb"sim listening on (http://127\.0\.0\.1:\d+)\n", line)
    assert match, line
    yield SimProcess(process, match.group(1).decode())
    if process.returncode is None:
        process.kill()
        await process.wait()


async def test_serves_then_stops_cleanly_on_sigterm(sim_process: SimProcess) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(sim_process.url + "/v1/models") as response:
            models = await response.json()
        assert [m["id"] for m in models["data"]] == ["m1", "m2"]
        body = {"model": "m2", "prompt": "Hi", "max_tokens": 2}
        async with http.post(sim_process.url + "/v1/completions", json=body) as response:
            assert response.status == 200
    sim_process.process.send_signal(signal.SIGTERM)
    assert await within(sim_process.process.wait(), 10) == 0


async def test_crash_knob_exits_with_status_1(sim_process: SimProcess) -> None:
    async with aiohttp.ClientSession() as http:
        try:
            async with http.post(sim_process.url + "/sim/faults", json={"crash": True}) as resp:
                await resp.read()
        except aiohttp.ClientError:
            pass  # dying before the answer got out is a fair crash too
    assert await within(sim_process.process.wait(), 10) == 1


async def test_bad_flags_exit_2_with_a_reason() -> None:
    process = await spawn("--port", "0", "--kv-blocks", "1", "--max-model-len", "4096")
    async with asyncio.timeout(15):
        _, stderr = await process.communicate()
    assert process.returncode == 2
    assert b"max_model_len" in stderr
