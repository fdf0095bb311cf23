"""`globalpool worker --launch -- ...`: the agent runs its engine (here the simulator, a real
HTTP server in a child process), restarts it after a crash and stops it after the drain.

The same path runs against real vLLM servers in tests/vllm (`pytest -m vllm`).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from pathlib import Path

import pytest

from tests.integration.test_worker_agent import (
    assert_clean_exit,
    finish,
    is_state,
    subscribed,
)
from tests.procfs import children
from worker.heartbeat_keys import HeartbeatKeys
from worker.schema import Heartbeat, LifecycleState

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def start_agent(*argv: str) -> tuple[asyncio.subprocess.Process, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "worker.cli", *argv,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert process.stdout is not None
    async with asyncio.timeout(15):
        banner = await process.stdout.readline()
    return process, banner.decode().strip()


async def engine_pid(agent: asyncio.subprocess.Process, timeout_s: float = 10.0) -> int:
    async with asyncio.timeout(timeout_s):
        while not (found := children(agent.pid)):  # noqa: ASYNC110 - /proc has no Event
            await asyncio.sleep(0.05)
    [pid] = found
    return pid


def sim_command(port: int) -> list[str]:
    return [sys.executable, "-m", "router.cli", "sim", "--host", "127.0.0.1", "--port",
            str(port), "--served-model-name", "tiny-llama", "--max-num-seqs", "4"]


async def test_launched_engine_is_restarted_after_a_crash_and_stopped_after_the_drain(
    redis_url: str, key_prefix: str
) -> None:
    keys = HeartbeatKeys(key_prefix)
    port = free_port()
    async with subscribed(redis_url, keys) as channel:
        agent, banner = await start_agent(
            "--region", "us-east", "--redis-url", redis_url, "--key-prefix", key_prefix,
            "--interval-s", "0.1", "--ttl-s", "0.5", "--max-restart-backoff-s", "0.5",
            "--launch", "--", *sim_command(port),
        )
        try:
            first = await channel.next(timeout_s=5)
            ready = await channel.until(is_state(LifecycleState.READY), timeout_s=20)
            crashed_pid = await engine_pid(agent)
            os.kill(crashed_pid, signal.SIGKILL)
            degraded = await channel.until(is_state(LifecycleState.DEGRADED), timeout_s=2)
            again = await channel.until(is_state(LifecycleState.READY), timeout_s=20)
            restarted_pid = await engine_pid(agent)
            agent.send_signal(signal.SIGTERM)
            await channel.until(is_state(LifecycleState.DRAINING))
            gone = await channel.until(lambda item: isinstance(item, str), timeout_s=10)
            code, stderr = await finish(agent)
        finally:
            if agent.returncode is None:
                agent.kill()
                await agent.wait()

    assert banner == f"worker us-east-127.0.0.1-{port} publishing to {redis_url} every 0.1s"
    assert isinstance(first, Heartbeat) and first.state is LifecycleState.STARTING
    assert isinstance(ready, Heartbeat)
    assert ready.endpoint == f"http://127.0.0.1:{port}"
    assert ready.capacity.max_num_seqs == 4, "read from the launched command"
    assert ready.engine.kind == "sim" and ready.engine.version
    assert "vllm:num_requests_running" in ready.engine.metric_names
    assert isinstance(degraded, Heartbeat) and isinstance(again, Heartbeat)
    assert restarted_pid != crashed_pid
    assert gone == f"gone:us-east-127.0.0.1-{port}"
    assert code == 0
    assert not alive(restarted_pid), "the engine is stopped with the agent"
    assert f"engine (pid {crashed_pid}) was killed by SIGKILL" in stderr
    assert "restarting in 0.5 s (restart 1)" in stderr
    assert f"engine started (pid {restarted_pid}, launch 2)" in stderr
    assert f"stopping engine (pid {restarted_pid}): SIGTERM to its process group" in stderr
    assert_clean_exit(stderr)


async def test_an_engine_that_never_becomes_healthy_is_given_up(
    redis_url: str, key_prefix: str, tmp_path: Path
) -> None:
    keys = HeartbeatKeys(key_prefix)
    log_path = tmp_path / "engine.log"
    async with subscribed(redis_url, keys) as channel:
        agent, _ = await start_agent(
            "--region", "us-east", "--redis-url", redis_url, "--key-prefix", key_prefix,
            "--interval-s", "0.1", "--ttl-s", "0.5", "--start-timeout-s", "1",
            "--max-failed-starts", "2", "--max-restart-backoff-s", "0.5",
            "--engine-log", str(log_path),
            "--launch", "--", sys.executable, "-c",
            "import time; print('loading weights', flush=True); time.sleep(60)",
            "--port", str(free_port()),
        )
        try:
            starting = await channel.next(timeout_s=5)
            degraded = await channel.until(is_state(LifecycleState.DEGRADED), timeout_s=5)
            gone = await channel.until(lambda item: isinstance(item, str), timeout_s=5)
            code, stderr = await finish(agent)
        finally:
            if agent.returncode is None:
                agent.kill()
                await agent.wait()

    assert isinstance(starting, Heartbeat) and starting.state is LifecycleState.STARTING
    assert isinstance(degraded, Heartbeat)
    assert isinstance(gone, str)
    assert code == 1
    assert "did not answer /health within 1 s; killing it" in stderr
    assert "restarting in 0.5 s (restart 1)" in stderr
    assert "did not become healthy 2 launches in a row" in stderr
    assert "giving up" in stderr
    assert log_path.read_text() == "loading weights\n" * 2
    assert_clean_exit(stderr)
