"""The keep-alive connections to the workers, per (host, port): connecting, reusing the
most recently used idle one, and closing those idle for `keepalive_s`."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import ssl as ssl_module
from typing import cast

from router.proxy.upstream.connection import UpstreamConnection
from router.proxy.upstream.errors import ConnectFailed, UpstreamError

_SWEEP_SLACK_S = 0.005  # the sweeper may close a connection this much early (timer rounding)
# A connect whose deadline passed is looked at once more this much later (see _connect).
CONNECT_GRACE_S = 0.05
# `warm` counts an idle connection only if it stays usable this much longer.
WARM_SPARE_S = 1.0


class UpstreamPool:
    """Keep-alive connections to the workers, per (host, port), most recently used first.

    One per router process; `close` it at shutdown. No request is ever written on a
    connection whose previous answer was not completely read.
    """

    def __init__(
        self, *, connect_timeout_s: float, keepalive_s: float = 4.0, max_idle_per_host: int = 1024,
        local_host: str | None = None,
    ) -> None:
        """`connect_timeout_s` bounds a TCP connect; an idle connection is closed after
        `keepalive_s`; beyond `max_idle_per_host` idle ones per worker, the oldest is closed."""
        if connect_timeout_s <= 0 or keepalive_s <= 0 or max_idle_per_host < 0:
            raise ValueError("connect_timeout_s and keepalive_s must be > 0, "
                             "max_idle_per_host >= 0")
        self._connect_timeout_s = connect_timeout_s
        self._keepalive_s = keepalive_s
        self._max_idle_per_host = max_idle_per_host
        # Connections leave from this address (None: the system's choice). The bench's
        # test bed gives each region's router its own loopback source address.
        self._local_addr = (local_host, 0) if local_host else None
        self._idle: dict[tuple[str, int], collections.deque[UpstreamConnection]] = {}
        self._open: set[UpstreamConnection] = set()
        # Connections being opened ahead (`warm`), per (host, port), until parked.
        self._warming: dict[tuple[str, int], set[asyncio.Task[None]]] = {}
        self._opened = 0
        self._reused = 0
        self._warmed = 0
        self._sweep: asyncio.TimerHandle | None = None
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The running loop, looked up once (`asyncio.get_running_loop()` makes a system
        call each time): the pool is used from one loop."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        return loop

    async def send(self, host: str, port: int, payload: bytes, *,
                   ssl: ssl_module.SSLContext | None = None) -> UpstreamConnection:
        """Write `payload` (see `request.encode_request`) to the worker; its answer is
        pending.

        Takes the most recently used idle connection that is open and idle for less than
        `keepalive_s`, else connects. Raises ConnectFailed when the connect fails or takes
        longer than `connect_timeout_s`; UpstreamError after `close`. A broken reused
        connection shows later, as ConnectionBroken(stale=True) from head() or a read.
        """
        connection = self.send_idle(host, port, payload)
        if connection is not None:
            return connection
        warming = self._warming.get((host, port))
        if warming:  # opened ahead: the first of them comes sooner than a new one
            await asyncio.wait(set(warming), return_when=asyncio.FIRST_COMPLETED)
            connection = self.send_idle(host, port, payload)
            if connection is not None:
                return connection
        connection = await self._connect((host, port), ssl)
        connection.begin(payload, reused=False)
        return connection

    def send_idle(self, host: str, port: int, payload: bytes) -> UpstreamConnection | None:
        """`send` on an idle connection, without an await; None if there is none (then
        `send`). UpstreamError after `close`."""
        if self._closed:
            raise UpstreamError("the upstream pool is closed")
        connection = self._take_idle((host, port))
        if connection is not None:
            self._reused += 1
            connection.begin(payload, reused=True)
        return connection

    def warm(self, host: str, port: int, count: int = 1,
             ssl: ssl_module.SSLContext | None = None) -> None:
        """Open connections to the worker ahead of requests that may come (hedged copies),
        until `count` are idle (for a second more at least) or being opened: each parked
        once open, as a released one is (closed after `keepalive_s` unused). A `send`
        meanwhile waits for the first of them rather than open another. A failed connect
        is dropped: the request that comes connects itself."""
        if self._closed:
            return
        key = (host, port)
        warming = self._warming.get(key)
        missing = count - self._idle_for(key, WARM_SPARE_S) - (len(warming) if warming else 0)
        if missing <= 0:
            return
        if warming is None:
            warming = self._warming[key] = set()
        for _ in range(missing):
            warming.add(self.loop.create_task(self._warm(key, ssl), name="upstream-warm"))

    async def _warm(self, key: tuple[str, int], ssl: ssl_module.SSLContext | None) -> None:
        try:
            connection = await self._connect(key, ssl)
        except UpstreamError:
            return
        finally:
            warming = self._warming[key]
            warming.discard(cast("asyncio.Task[None]", asyncio.current_task()))
            if not warming:
                del self._warming[key]
        self._warmed += 1
        self.park(connection)

    def _idle_for(self, key: tuple[str, int], spare_s: float) -> int:
        """Idle connections to `key` that stay usable for `spare_s` more at least."""
        idle = self._idle.get(key)
        if not idle:
            return 0
        due_s = idle[0].clock() + spare_s - self._keepalive_s
        return sum(1 for connection in idle if connection.idle_since > due_s)

    def stats(self) -> dict[str, int]:
        """Connections opened (of them, ahead of a request: `warmed`) and reuses since the
        start, and idle connections now."""
        idle = sum(len(connections) for connections in self._idle.values())
        return {"opened": self._opened, "reused": self._reused, "idle": idle,
                "warmed": self._warmed}

    async def close(self) -> None:
        """Abort every connection, idle or in use; `send` fails from now on."""
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for warming in list(self._warming.values()):
            for task in list(warming):
                task.cancel()
        for connection in list(self._open):
            connection.close()
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports report their loss

    async def _connect(self, key: tuple[str, int],
                       ssl: ssl_module.SSLContext | None) -> UpstreamConnection:
        host, port = key
        loop = asyncio.get_running_loop()
        factory = functools.partial(UpstreamConnection, self, key)
        connecting = loop.create_task(loop.create_connection(  # TLS handshake included
            factory, host, port, ssl=ssl, server_hostname=host if ssl else None,
            local_addr=self._local_addr))
        try:
            done, _ = await asyncio.wait((connecting,), timeout=self._connect_timeout_s)
            if not done:
                # After the host stalled this process, the loop runs expired timers before
                # it reads the sockets: a connect that completed meanwhile is not seen yet,
                # and would fail as a timeout (a healthy worker ejected). Look once more,
                # after the loop has polled.
                done, _ = await asyncio.wait((connecting,), timeout=CONNECT_GRACE_S)
            if not done:
                raise TimeoutError
            _, connection = connecting.result()
        except TimeoutError:
            connecting.cancel()
            raise ConnectFailed(
                f"connect to {host}:{port} timed out after {self._connect_timeout_s} s") from None
        except ConnectionRefusedError:
            raise ConnectFailed(f"connect to {host}:{port} refused") from None
        except OSError as exc:
            raise ConnectFailed(f"connect to {host}:{port} failed: {exc}") from exc
        except BaseException:  # we were cancelled: the connect must not go on alone
            if connecting.done() and not connecting.cancelled() and not connecting.exception():
                connecting.result()[0].close()  # made just now: nobody will use it
            connecting.cancel()
            raise
        self._opened += 1
        if self._closed:
            connection.close()
            raise UpstreamError("the upstream pool is closed")
        self._open.add(connection)
        return connection

    def _take_idle(self, key: tuple[str, int]) -> UpstreamConnection | None:
        idle = self._idle.get(key)
        while idle:
            connection = idle.pop()
            connection.parked = False
            if connection.idle_since + self._keepalive_s <= connection.clock():
                connection.close()  # expired, and so are all the older ones below it
                while idle:
                    connection = idle.pop()
                    connection.parked = False
                    connection.close()
                return None
            transport = connection.transport
            if transport is not None and not transport.is_closing():
                return connection
            connection.close()
        return None

    # -- the connections' calls (`sinks.ConnectionKeeper`) --

    def park(self, connection: UpstreamConnection) -> None:
        """A released connection: idle from now, most recently used; closed instead after
        `close` or when idle ones are not kept. The oldest beyond `max_idle_per_host` is
        closed."""
        if self._closed or self._max_idle_per_host == 0:
            connection.close()
            return
        idle = self._idle.get(connection.key)
        if idle is None:
            idle = self._idle[connection.key] = collections.deque()
        elif len(idle) >= self._max_idle_per_host:
            oldest = idle.popleft()
            oldest.parked = False
            oldest.close()
        connection.park()
        idle.append(connection)
        if self._sweep is None:
            loop = asyncio.get_running_loop()
            self._sweep = loop.call_at(connection.idle_since + self._keepalive_s, self._sweep_idle)

    def forget(self, connection: UpstreamConnection) -> None:
        """An idle connection closed: out of the pool."""
        connection.parked = False
        idle = self._idle.get(connection.key)
        if idle is not None:
            with contextlib.suppress(ValueError):  # already taken out
                idle.remove(connection)

    def lost(self, connection: UpstreamConnection) -> None:
        """A connection's transport is gone: no longer open, nor idle."""
        self._open.discard(connection)
        if connection.parked:
            self.forget(connection)

    def _sweep_idle(self) -> None:
        """Close the connections idle for `keepalive_s`; come back for the next one due."""
        self._sweep = None
        loop = asyncio.get_running_loop()
        expired_since = loop.time() + _SWEEP_SLACK_S - self._keepalive_s
        next_due = float("inf")
        for key in list(self._idle):
            idle = self._idle[key]
            while idle and idle[0].idle_since <= expired_since:
                connection = idle.popleft()
                connection.parked = False
                connection.close()
            if idle:
                next_due = min(next_due, idle[0].idle_since + self._keepalive_s)
            else:
                del self._idle[key]
        if next_due != float("inf"):
            self._sweep = loop.call_at(next_due, self._sweep_idle)
