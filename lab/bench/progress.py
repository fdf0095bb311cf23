"""The benchmark's progress bar: one text line on stderr while a policy's replay runs."""

from __future__ import annotations

import asyncio
import sys
import time
from typing import TextIO

from lab.bench.replay import Replayer


class ProgressBar:
    """A one-line text bar on stderr (a line every few seconds when not a terminal)."""

    def __init__(self, stream: TextIO = sys.stderr, width: int = 30) -> None:
        self.stream = stream
        self.width = width
        self.tty = stream.isatty()
        self._last_line_s = 0.0

    def show(self, label: str, replayer: Replayer, duration_s: float, final: bool = False
             ) -> None:
        now = replayer.now_s()
        done = min(1.0, now / duration_s) if duration_s > 0 else 1.0
        filled = int(done * self.width)
        errors = sum(not o.ok for o in replayer.outcomes)
        line = (f"{label:<16} [{'#' * filled}{'.' * (self.width - filled)}] {100 * done:3.0f}% "
                f"t={now:5.1f}/{duration_s:g}s sent {replayer.sent} open {replayer.in_flight} "
                f"done {len(replayer.outcomes)} errors {errors}")
        if self.tty:
            self.stream.write("\r" + line + ("\n" if final else ""))
            self.stream.flush()
        elif final or time.monotonic() - self._last_line_s >= 5.0:
            self._last_line_s = time.monotonic()
            print(line, file=self.stream, flush=True)

    async def follow(self, label: str, replayer: Replayer, duration_s: float) -> None:
        while True:
            self.show(label, replayer, duration_s)
            await asyncio.sleep(0.5)
