"""`FrontSite`: the aiohttp site that listens for the router and starts every connection
on `router.proxy.front.FrontProtocol`.

Apart from the front because it subclasses aiohttp's `TCPSite` (a class with `__slots__`),
which the compiled build (`setup.py`) cannot compile; the front's modules are compiled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

from aiohttp import web

from router.proxy.aiohttp_server import json_errors_handler
from router.proxy.exchange import InferenceHandler
from router.proxy.front import FrontProtocol
from router.proxy.shares import DEFER_S, MAX_DEFERS, ConnectionShares

# Connections the kernel queues for accept (aiohttp's default, 128, filled in seconds when
# a couple of thousand clients connect while the host stalls the router: they then saw
# resets and SYN retries). The kernel caps it at net.core.somaxconn.
LISTEN_BACKLOG = 4096

log = logging.getLogger("globalpool.front")


class FrontSite(web.TCPSite):
    """A TCP site whose connections start on `FrontProtocol` (aiohttp's otherwise).

    `handler` serves inference exchanges. Stopping waits up to
    `shutdown_timeout_s` for requests in progress, as aiohttp does for its own. `sock`: a
    listening socket to accept on instead of host:port (one that sibling processes share,
    router.processes), its connections shared with theirs through `shares`; stopping
    closes this process's copy only.
    """

    def __init__(self, runner: web.BaseRunner, host: str | None, port: int | None, *,
                 handler: InferenceHandler, header_timeout_s: float,
                 shutdown_timeout_s: float = 60.0, reuse_address: bool | None = None,
                 backlog: int = LISTEN_BACKLOG, sock: socket.socket | None = None,
                 shares: ConnectionShares | None = None) -> None:
        super().__init__(runner, host, port, reuse_address=reuse_address, backlog=backlog)
        self._sock = sock
        self._shares = shares
        self._accepting: asyncio.Task[None] | None = None  # accepting on `sock`
        self._waiting = False  # `_accepting` waits (for a connection, or its turn)
        self.handler = handler
        self.header_timeout_s = header_timeout_s
        self.shutdown_timeout_s = shutdown_timeout_s
        self.connections: set[FrontProtocol] = set()
        self.stopping = False
        self._drained = asyncio.Event()

    def aiohttp_protocol(self) -> asyncio.Protocol:
        server = self._runner.server
        assert server is not None
        return json_errors_handler(server)  # (aiohttp's errors in OpenAI's format)

    async def start(self) -> None:
        self._runner._reg_site(self)
        loop = asyncio.get_running_loop()
        if self._sock is not None:
            self._sock.setblocking(False)
            listening = loop.create_future()
            self._accepting = loop.create_task(self._accept(self._sock, listening),
                                               name="front-accept")
            self._bound_port = self._sock.getsockname()[1]
            # Returned (and "router listening on" logged) only once this process takes
            # connections and its siblings see it accepting: until then a sibling would
            # take a whole burst of keep-alive connections without deferring once.
            await asyncio.wait([listening, self._accepting],
                               return_when=asyncio.FIRST_COMPLETED)
            if not listening.done():
                await self._accepting  # it failed before it could accept: raise that
            return
        self._server = await loop.create_server(lambda: FrontProtocol(self), self._host,
                                                self._port, backlog=self._backlog,
                                                reuse_address=self._reuse_address)
        self._bound_port = self._server.sockets[0].getsockname()[1]

    async def _accept(self, sock: socket.socket, listening: asyncio.Future[None]) -> None:
        """Accept on a socket shared with sibling processes, sharing its connections with
        them (`router.proxy.shares`: asyncio's own server would take every connection
        waiting when it wakes, and one process would keep a whole burst). `listening` is
        set once the loop watches the socket and the siblings see this process accept."""
        loop = asyncio.get_running_loop()
        shares = self._shares
        ready: asyncio.Future[None] | None = None

        def readable() -> None:
            if ready is not None and not ready.done():
                ready.set_result(None)

        loop.add_reader(sock.fileno(), readable)
        if shares is not None:
            shares.set_open(len(self.connections))
        listening.set_result(None)
        defers = 0
        # `stop` cancels this task only while it waits (`_waiting`): cancelled while it
        # sets up a connection it has accepted, the connection would be closed under its
        # client, who has just sent a request. Stopping then, it ends after the set-up.
        try:
            while not self.stopping:
                self._waiting = True
                if shares is not None:
                    shares.set_open(len(self.connections))
                    if defers < MAX_DEFERS and shares.over_share():
                        defers += 1
                        await asyncio.sleep(DEFER_S)  # a sibling with fewer takes it
                        continue
                defers = 0
                try:
                    connection, _ = sock.accept()
                except BlockingIOError:  # none waiting, or a sibling took it
                    ready = loop.create_future()
                    await ready
                    continue
                except OSError as exc:  # EMFILE and the like: log, breathe, go on
                    log.warning("accept failed: %s", exc)
                    await asyncio.sleep(0.1)
                    continue
                self._waiting = False
                connection.setblocking(False)
                try:
                    await loop.connect_accepted_socket(lambda: FrontProtocol(self), connection)
                except OSError:
                    connection.close()  # gone before it was set up
        finally:
            self._waiting = False
            loop.remove_reader(sock.fileno())
            if shares is not None:
                shares.stop_accepting()

    async def stop(self) -> None:
        self.stopping = True
        if self._accepting is not None and self._sock is not None:
            if self._waiting:
                self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
            self._accepting = None
            self._sock.close()  # this process's copy: the siblings still accept on theirs
        await super().stop()  # no new connections
        for connection in list(self.connections):
            connection.close_when_idle()
        if self.connections:
            try:
                async with asyncio.timeout(self.shutdown_timeout_s):
                    await self._drained.wait()
            except TimeoutError:
                left = list(self.connections)
                log.warning("stopping: %d connection(s) still open after %g s, cut now "
                            "(serving: %s)", len(left), self.shutdown_timeout_s,
                            ", ".join(str(c.serving() or "nothing") for c in left[:10]))
        for connection in list(self.connections):
            connection.transport.abort()

    def closed(self, connection: FrontProtocol) -> None:
        """`connection` is gone or handed over."""
        self.connections.discard(connection)
        if self._shares is not None and self._accepting is not None:
            self._shares.set_open(len(self.connections))
        if self.stopping and not self.connections:
            self._drained.set()
