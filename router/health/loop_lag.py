"""How late this process's event loop has run, and when: the router's own delays.

A first byte that reached the socket while the loop could not run (a busy host, a CPU hog
beside the router, the router's own backlog) is read late: that time is the router's,
not the worker's or the path's, and must not be learnt about them
(router.health.penalties). `LoopLag.watch` sets a timer every `tick_s`; one that fires
later than due by more than TOLERANCE_S shows that the loop could not run for that long
until then, and is kept with when it fired. `around(t)` is the longest such wait seen
within a tick of `t`: when the loop comes back after a stall, it reads the data that
arrived meanwhile and fires the overdue timer together.

Not a sum over an attempt's whole wait: on a busy loop every tick is a little late, and
those moments add up to nothing a first byte waited for (on the slow-region drill a sum
over the wait read most of a 300 ms path delay as the router's own).
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections.abc import Callable

TICK_S = 0.02  # 50 wakeups a second: ~0.1 % of a core
TOLERANCE_S = 0.002
KEEP = 4096  # lateness events kept (at 50 a second, at least 80 s of them)


class LoopLag:
    """When the loop ran late, and by how much; `total_s` is the sum (for operators)."""

    __slots__ = ("_clock", "_lates", "_times", "total_s")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.total_s = 0.0
        self._times: list[float] = []
        self._lates: list[float] = []

    def record(self, late_s: float, now_s: float) -> None:
        """The loop could not run for `late_s` until `now_s` (the monotonic clock)."""
        self.total_s += late_s
        self._times.append(now_s)
        self._lates.append(late_s)
        if len(self._times) > KEEP:
            half = KEEP // 2
            del self._times[:half], self._lates[:half]

    def around(self, at_s: float, window_s: float = TICK_S) -> float:
        """The longest the loop could not run, as seen within `window_s` of `at_s`: how
        late something that became ready then was handled (0: the loop ran on time)."""
        times = self._times
        if not times or times[-1] < at_s - window_s:
            return 0.0  # the usual answer: no lateness lately
        first = bisect.bisect_left(times, at_s - window_s)
        last = bisect.bisect_right(times, at_s + window_s)
        return max(self._lates[first:last], default=0.0)

    async def watch(self, tick_s: float = TICK_S) -> None:
        """Measure until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(tick_s)
            late_s = loop.time() - before - tick_s
            if late_s > TOLERANCE_S:
                self.record(late_s, self._clock())
