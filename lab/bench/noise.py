"""Host noise: bounded CPU hogs beside the routers while a policy is measured.

A shared machine is never quiet: other tenants, a compaction, a neighbour's build. The
`host-noise` scenario measures what routing does then. `HostNoise` starts
`processes` children (`python -m lab.bench.noise`), each spinning `duty` of every
`period_ms` on whatever core the kernel gives it and sleeping the rest, and stops them
after the run. Each child is bounded three ways, so that none can outlive the benchmark:
`stop()` kills it by PID (SIGTERM, then SIGKILL); it exits by itself after `--max-s`; and
it exits as soon as its parent is gone (its parent PID changes).

The twin has no CPU to disturb: next to a noisy run it is the no-noise reference.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Sequence

from lab.bench.scenario import HostNoise as HostNoiseSpec

STOP_GRACE_S = 2.0


def spin(duty: float, period_s: float, max_s: float, parent_pid: int) -> int:
    """Busy `duty` of every `period_s`, for at most `max_s`, while `parent_pid` lives.
    Returns the periods run."""
    deadline = time.monotonic() + max_s
    periods = 0
    while time.monotonic() < deadline and os.getppid() == parent_pid:
        start = time.monotonic()
        busy_until = start + duty * period_s
        while time.monotonic() < busy_until:
            pass
        rest = start + period_s - time.monotonic()
        if rest > 0:
            time.sleep(rest)
        periods += 1
    return periods


class HostNoise:
    """`async with HostNoise(spec, max_s):` the hogs run inside the block, none after."""

    def __init__(self, spec: HostNoiseSpec, max_s: float) -> None:
        self.spec = spec
        self.max_s = max_s
        self.processes: list[asyncio.subprocess.Process] = []

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    async def start(self) -> None:
        for _ in range(self.spec.processes):
            self.processes.append(await asyncio.create_subprocess_exec(
                sys.executable, "-m", "lab.bench.noise", "--duty", str(self.spec.duty),
                "--period-ms", str(self.spec.period_ms), "--max-s", str(self.max_s),
                "--parent-pid", str(os.getpid()),
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL))

    async def stop(self) -> None:
        """Terminate every child it started (by PID), kill any still there after a grace
        period, and reap them all."""
        for process in self.processes:
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.terminate()
        for process in self.processes:
            try:
                async with asyncio.timeout(STOP_GRACE_S):
                    await process.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        self.processes.clear()

    async def __aenter__(self) -> HostNoise:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.bench.noise",
                                     description="spin on one core with a duty cycle")
    parser.add_argument("--duty", type=float, required=True)
    parser.add_argument("--period-ms", type=float, default=50.0)
    parser.add_argument("--max-s", type=float, required=True)
    parser.add_argument("--parent-pid", type=int, default=None)
    args = parser.parse_args(argv)
    duty = min(1.0, max(0.0, args.duty))
    spin(duty, args.period_ms / 1000.0, args.max_s, args.parent_pid or os.getppid())
    return 0


if __name__ == "__main__":
    sys.exit(main())
