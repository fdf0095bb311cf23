"""Time for the engine model, injected so that engine tests run in virtual time.

The engine only asks two things of time: what the monotonic time is (seconds) and to
wait for a simulated GPU step. `SystemClock` uses the running loop; `VirtualClock` makes
every wait instant and advances its own time instead, so a test of a minute of traffic
takes milliseconds and always sees the same timestamps.
"""

from __future__ import annotations

import asyncio
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Monotonic time in seconds."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Wait `seconds` of this clock's time."""
        ...


class SystemClock:
    """Real time: the event loop's monotonic clock."""

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class VirtualClock:
    """Time that moves only when the engine sleeps (or a test calls `advance`).

    `sleep` still yields to the loop once so that consumers of the step's tokens run
    between steps, in the same order as they would in real time.
    """

    def __init__(self, start_s: float = 0.0) -> None:
        self._now_s = start_s

    def now(self) -> float:
        return self._now_s

    def advance(self, seconds: float) -> None:
        self._now_s += seconds

    async def sleep(self, seconds: float) -> None:
        self._now_s += max(0.0, seconds)
        await asyncio.sleep(0)
