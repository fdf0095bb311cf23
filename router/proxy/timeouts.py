"""The time limits of one upstream attempt, as cheap as timers.

Timeouts are split by phase (see `router.config.Timeouts`):
- connect: TCP connect to the worker (and TLS, for https endpoints);
- first byte: request sent -> response headers and, for streams, the first body chunk.
  For non-streaming requests the engine answers only when generation is done, so that
  phase is bounded by `total_s` instead;
- idle: the longest gap between two chunks of a stream once it has started;
- total: the whole attempt.

`Deadline` bounds the wait for an answer (the first byte, or a whole unary answer);
`IdleWatchdog` watches a started stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from router.config import Timeouts
from router.proxy.exchange import Exchange
from router.proxy.upstream.connection import UpstreamConnection


class IdleWatchdog:
    """Watches a started stream: a worker that goes silent, a client that stops reading.

    The upstream connection counts its reads; a timer that wakes every quarter of its
    shortest bound notes when the count last moved. Silence counts against the worker
    only while the router is reading from it (`UpstreamConnection.reading`): while a
    slow client holds the stream back, the router has paused the worker, and its silence
    is ours. So a stall is caught between `idle_s` and 1.25 x `idle_s` of the router
    asking for data in vain. While the router is held back, the client is watched
    instead: when it has taken nothing for `client_stall_s` (its write buffer neither
    shrank nor let the worker's data flow), it is cut off (`on_client_stall`). A stream
    past `total_s` ends as the worker's fault if the router was reading, the client's if
    it was held back. Nothing is re-armed, and no clock read, per chunk.
    """

    __slots__ = ("_client_pending", "_client_stall_s", "_deadline", "_exchange", "_handle",
                 "_held_since", "_idle_s", "_interval_s", "_loop", "_on_client_stall",
                 "_quiet_since", "_reads", "_upstream", "client_fired", "fired")

    def __init__(self, loop: asyncio.AbstractEventLoop, upstream: UpstreamConnection,
                 exchange: Exchange, timeouts: Timeouts, client_stall_s: float,
                 on_client_stall: Callable[[], None]) -> None:
        self._loop = loop
        self._upstream = upstream
        self._exchange = exchange
        self._idle_s = idle_s = timeouts.idle_s
        self._client_stall_s = client_stall_s
        self._on_client_stall = on_client_stall
        now = loop.time()
        self._deadline = now + timeouts.total_s
        self._reads = upstream.reads
        self._quiet_since = now  # the stream's first bytes were just read
        self._held_since: float | None = None  # the client holds the stream back since
        self._client_pending = 0
        self.fired: str | None = None  # the worker's fault
        self.client_fired: str | None = None  # the client's
        self._interval_s = min(idle_s, client_stall_s, timeouts.total_s) / 4
        self._handle = self._loop.call_later(self._interval_s, self._check)

    def _check(self) -> None:
        now = self._loop.time()
        upstream = self._upstream
        reads = upstream.reads
        moved = reads != self._reads
        self._reads = reads
        if upstream.reading:
            self._held_since = None
            if moved:
                self._quiet_since = now
            elif now - self._quiet_since >= self._idle_s:
                self.fired = f"no data from the worker for {self._idle_s:g} s"
            if self.fired is None and now >= self._deadline:
                self.fired = "the request ran past its total timeout"
        else:
            self._quiet_since = now  # not asking the worker for anything: not its silence
            self._client_held(now, moved)
        if self.fired is not None:
            upstream.close()
            return
        if self.client_fired is not None:
            self._on_client_stall()
            return
        self._handle = self._loop.call_later(self._interval_s, self._check)

    def _client_held(self, now: float, moved: bool) -> None:
        pending = self._exchange.client_pending_bytes()
        if self._held_since is None or moved or pending < self._client_pending:
            self._held_since = now  # (still) taking what it is sent
        elif now - self._held_since >= self._client_stall_s:
            self.client_fired = f"the client read nothing for {self._client_stall_s:g} s"
        if self.client_fired is None and now >= self._deadline:
            self.client_fired = "the client read too slowly to finish within the total timeout"
        self._client_pending = pending

    def cancel(self) -> None:
        self._handle.cancel()


class Deadline:
    """The time limit on one attempt's wait for its answer, as cheap as a timer.

    When it expires it closes the attempt's upstream connection, which fails the pending
    read, or cancels the waiting task while it is still connecting (`asyncio.timeout`
    does the same with more bookkeeping: it cost ~10 us per request here).
    `reschedule(now)` is how health abandons a stalled attempt (`Attempt.abandon`).
    """

    __slots__ = ("_cancelled", "_handle", "_loop", "_task", "expired", "upstream")

    def __init__(self, delay_s: float, loop: asyncio.AbstractEventLoop) -> None:
        """`loop` is the running loop (the caller's, at hand: looking it up costs a
        system call)."""
        self._loop = loop
        self._task = asyncio.current_task(loop)
        self.upstream: UpstreamConnection | None = None
        self.expired = False
        self._cancelled = False  # it cancelled the task
        self._handle = self._loop.call_later(delay_s, self._expire)

    def reschedule(self, when: float | None) -> None:
        """Expire at loop time `when` instead (None: never)."""
        self._handle.cancel()
        if when is not None and not self.expired:
            self._handle = self._loop.call_at(when, self._expire)

    def cancel(self) -> None:
        self._handle.cancel()

    def _expire(self) -> None:
        self.expired = True
        if self.upstream is not None:
            self.upstream.close()
        elif self._task is not None:
            self._task.cancel()
            self._cancelled = True

    def timed_out(self) -> bool:
        """After a CancelledError: True if this deadline caused it (and it is taken
        back), False if something else cancelled the task."""
        return self._cancelled and self._task is not None and self._task.uncancel() == 0

