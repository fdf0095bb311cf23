"""The host-noise CPU hogs (lab.bench.noise): real child processes that start, burn about
their duty of a core, stop when told, and cannot outlive their time bound or parent."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from lab.bench.noise import HostNoise, spin
from lab.bench.scenario import HostNoise as HostNoiseSpec
from tests.conftest import ROOT, within

TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_S


def gone(pid: int) -> bool:
    """Exited: no such process, or a zombie its (new) parent has not reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if gone(pid):
            return True
        time.sleep(0.05)
    return gone(pid)


def test_spin_keeps_its_period_and_its_bound() -> None:
    started = time.monotonic()
    periods = spin(0.5, 0.02, 0.2, os.getppid())
    assert 0.2 <= time.monotonic() - started < 0.5
    assert 5 <= periods <= 11
    assert spin(0.5, 0.02, 5.0, parent_pid=-1) == 0  # not its parent: stops at once


async def test_hogs_burn_their_duty_and_are_killed_by_pid() -> None:
    noise = HostNoise(HostNoiseSpec(processes=2, duty=0.7, period_ms=20), max_s=30.0)
    async with noise:
        pids = noise.pids
        assert len(pids) == 2 and os.getpid() not in pids
        await asyncio.sleep(0.3)  # the interpreter's start-up
        before = {pid: cpu_s(pid) for pid in pids}
        await asyncio.sleep(1.0)
        used = {pid: cpu_s(pid) - before[pid] for pid in pids}
        assert not any(gone(pid) for pid in pids)
    # ~0.7 of a core each when the host is free; any share at all when other work holds
    # the 2 cores (a shared host gives no floor), never more than one core.
    assert all(0.0 < share <= 1.05 for share in used.values()), used
    assert noise.pids == [] and all(gone(pid) for pid in pids)


async def test_a_hog_stops_by_itself_at_its_time_bound() -> None:
    noise = HostNoise(HostNoiseSpec(processes=1, duty=0.2, period_ms=20), max_s=0.5)
    await noise.start()
    process = noise.processes[0]
    try:
        assert await within(process.wait(), 10.0) == 0
    finally:
        await noise.stop()


async def test_no_hog_is_started_without_processes() -> None:
    async with HostNoise(HostNoiseSpec(processes=0), max_s=5.0) as noise:
        assert noise.pids == []


def test_a_hog_exits_when_its_parent_dies() -> None:
    """The benchmark killed with SIGKILL runs no `finally`: its hogs see their parent gone
    and stop within a period."""
    program = (
        "import asyncio, sys\n"
        "from lab.bench.noise import HostNoise\n"
        "from lab.bench.scenario import HostNoise as Spec\n"
        "async def main():\n"
        "    noise = HostNoise(Spec(processes=1, duty=0.5, period_ms=20), max_s=60.0)\n"
        "    await noise.start()\n"
        "    print(noise.pids[0], flush=True)\n"
        "    await asyncio.sleep(60)\n"
        "asyncio.run(main())\n")
    parent = subprocess.Popen([sys.executable, "-c", program], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert parent.stdout is not None
        hog = int(parent.stdout.readline())
        time.sleep(0.3)
        assert not gone(hog)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        assert wait_gone(hog, 5.0)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=10)
