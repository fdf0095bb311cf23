"""Background tasks that cannot die unnoticed: each crash is logged with its traceback,
counted, and followed by a restart with backoff.

A router's background work (the heartbeat collector, the stall watch, the peer exchange,
drain flags, the config watcher) runs for the app's lifetime. A bug in any of them must
not leave the router serving a frozen view while it says it is fine: `Supervised` runs
the loop, and when it raises, logs the traceback, counts the crash (`crashes`, exported
as `globalpool_background_task_crashes_total{task}`), calls `on_down` (what the task feeds
is marked stale, readiness fails), waits (0.1 s, doubling up to 5 s; back to 0.1 s after a
minute without a crash) and starts it again. Cancellation (shutdown) ends it, whatever
error the loop ends with once cancelled. A loop that has not ended `STOP_WAIT_S` after its
cancel (one that swallowed it) is logged with where it is, cancelled again, and after a
second wait left behind, so that stopping the router cannot hang on it.
"""

from __future__ import annotations

import asyncio
import io
import logging
import time
from collections.abc import Awaitable, Callable

from worker.redis_client import raise_if_cancelling

log = logging.getLogger("globalpool.supervisor")

MIN_BACKOFF_S = 0.1
MAX_BACKOFF_S = 5.0
# A task that has run this long since its last crash is trusted again: backoff resets.
STABLE_AFTER_S = 60.0
# How long `stop` waits for the task to end after each cancel (a loop ends in
# milliseconds; one that has not ended by then swallowed the cancel).
STOP_WAIT_S = 5.0


class Supervised:
    """One supervised background task (see the module doc)."""

    def __init__(self, name: str, loop_factory: Callable[[], Awaitable[None]], *,
                 on_down: Callable[[BaseException], None] | None = None,
                 on_up: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`loop_factory()` makes the task's coroutine anew for each start; `on_down(exc)`
        runs after a crash, `on_up()` before every restart."""
        self.name = name
        self._factory = loop_factory
        self._on_down = on_down
        self._on_up = on_up
        self._clock = clock
        self.crashes = 0
        self.running = False
        self.last_error: str | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> Supervised:
        self._task = asyncio.create_task(self._supervise(), name=self.name)
        return self

    async def stop(self, wait_s: float = STOP_WAIT_S) -> None:
        """Cancel it and wait until it has ended: at most twice `wait_s`, cancelling it
        again in between (see the module doc)."""
        task = self._task
        if task is None:
            return
        for attempt in (1, 2):
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=wait_s)
            if done:
                await asyncio.gather(task, return_exceptions=True)
                return
            where = io.StringIO()
            task.print_stack(file=where)
            log.error("background task %s has not stopped %g s after it was cancelled; %s; "
                      "it is at:\n%s", self.name, wait_s,
                      "cancelling it again" if attempt == 1 else "left running",
                      where.getvalue().strip())

    async def _supervise(self) -> None:
        backoff_s = MIN_BACKOFF_S
        while True:
            started_s = self._clock()
            self.running = True
            try:
                await self._factory()
                raise RuntimeError("the task returned; it should run until cancelled")
            except asyncio.CancelledError:
                self.running = False
                raise
            except Exception as exc:
                self.running = False
                # Cancelled, and the loop ended with another error (redis-py turns a cancel
                # mid-command into ConnectionError): a shutdown, not a crash. Restarting
                # would swallow the cancel, and stop() would wait forever.
                raise_if_cancelling()
                self.crashes += 1
                self.last_error = f"{type(exc).__name__}: {exc}"[:300]
                if self._clock() - started_s >= STABLE_AFTER_S:
                    backoff_s = MIN_BACKOFF_S
                log.error("background task %s crashed (%d so far); restarting in %.1f s",
                          self.name, self.crashes, backoff_s, exc_info=exc)
                if self._on_down is not None:
                    self._call(self._on_down, exc)
            await asyncio.sleep(backoff_s)
            backoff_s = min(MAX_BACKOFF_S, backoff_s * 2)
            if self._on_up is not None:
                self._call(self._on_up)

    def _call(self, callback: Callable[..., None], *args: object) -> None:
        try:
            callback(*args)
        except Exception:  # a broken callback must not end the supervision
            log.exception("background task %s: its crash handler failed", self.name)
