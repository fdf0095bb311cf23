"""`globalpool up` starts everything, shows progress, and leaves no process behind."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from tests.conftest import ROOT, within
from tests.integration.stack import pid_alive, small_config, start_up

pytestmark = pytest.mark.integration


def _wait_gone(pids: list[int], timeout_s: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [pid for pid in alive if pid_alive(pid)]
    return alive


def test_ctrl_c_stops_every_child(tmp_path: Path) -> None:
    up = start_up(tmp_path, small_config(tmp_path))
    pids = up.all_pids()
    assert len(pids) == 1 + 6 + 6 + 1  # valkey, sims, agents, router
    assert all(pid_alive(pid) for pid in pids)
    up.process.send_signal(signal.SIGINT)
    assert up.process.wait(30) == 0
    assert _wait_gone(pids, 1.0) == []
    output = up.output()
    assert "[ 1/14] valkey" in output and "[14/14] router" in output
    assert "stopped; no child process left running" in output
    assert not (tmp_path / "up-state.json").exists()


def test_children_die_with_a_killed_up(tmp_path: Path) -> None:
    up = start_up(tmp_path, small_config(tmp_path))
    pids = up.all_pids()
    up.process.kill()
    up.process.wait(10)
    assert _wait_gone(pids) == []


def test_busy_port_fails_cleanly(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = small_config(tmp_path, router={"region": "us-east", "port": port})
        result = subprocess.run(
            [sys.executable, "-m", "router.cli", "up", "--config", str(config),
             "--log-dir", str(tmp_path / "logs")],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )
    assert result.returncode == 1
    assert f"globalpool up failed: the router cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "address already in use" in result.stderr.lower()
    assert "[1/" not in result.stdout  # found before anything started
    assert "stopped; no child process left running" in result.stdout


@pytest.mark.slow(why="a whole `up`, its Valkey killed and served again (~14 s)")
def test_a_dead_valkey_is_reported_restarted_and_reaped(tmp_path: Path) -> None:
    up = start_up(tmp_path, small_config(tmp_path))
    try:
        old_pid = int(up.state["redis_pid"])
        os.kill(old_pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while "valkey running again" not in up.output():
            assert time.monotonic() < deadline, up.output()
            assert up.process.poll() is None, up.output()
            time.sleep(0.1)
        output = up.output()
        assert f"note: valkey (pid {old_pid}) exited with -9" in output
        assert not pid_alive(old_pid)  # reaped: no `valkey-server <defunct>` left behind
        state = json.loads((tmp_path / "up-state.json").read_text())
        assert int(state["redis_pid"]) != old_pid and pid_alive(int(state["redis_pid"]))

        async def served_again() -> None:  # agents publish again; the router follows
            async with aiohttp.ClientSession() as session:
                while True:
                    async with session.post(
                            f"{up.url}/v1/chat/completions",
                            json={"model": "tiny-llama", "max_tokens": 2,
                                  "messages": [{"role": "user", "content": "hi"}]}) as reply:
                        if reply.status == 200:
                            return
                    await asyncio.sleep(0.2)

        asyncio.run(within(served_again(), 20))
    finally:
        assert up.stop() == 0, up.output()
