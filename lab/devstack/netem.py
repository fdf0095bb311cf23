"""Emulated wide-area network in front of a region's engines, in user space.

The kernel here has no `netem` qdisc, so a small asyncio TCP proxy plays its part: one
listening port per engine, on the region's own loopback address (127.0.X.1). Every byte
is delayed by half the round-trip time in each direction, in order; a new connection
first pays one round trip (the TCP handshake). Knobs, changed at run time:

- `extra_rtt_ms`: added to the region's RTT (a congested or rerouted path);
- `partition`: a blackhole. Connections are accepted (the kernel does that) but nothing is
  forwarded in either direction and nothing is answered, as if every packet were dropped;
  reading stops once a little data is held, as a full TCP window would. Held data flows
  on when the partition heals (TCP would retransmit it);
- `reset()`: every open connection is reset (RST) on both sides.

A dead engine stays visible as one: when the engine refuses a connection the client side
is reset and the listening port is closed, so further connects are refused as they would
be by the engine itself; the port reopens once the engine accepts again.

The RTT can depend on the client's address (`rtt_ms_by_source`), so that router replicas
in different regions, each binding its own region's address, see different distances.

Cost per chunk: one deque append and at most one timer per burst (not per chunk); the
data path is in lab.devstack.netem_pipe, the process with its control API in
lab.devstack.netem_process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

from lab.devstack.netem_knobs import NetemKnobs
from lab.devstack.netem_pipe import ClientSide, Connection, UpstreamSide

log = logging.getLogger("globalpool.netem")

UPSTREAM_PROBE_S = 0.05


class NetemLink:
    """One listening port in front of one upstream engine."""

    def __init__(self, knobs: NetemKnobs, listen_host: str, upstream_host: str,
                 upstream_port: int, listen_port: int = 0) -> None:
        self.knobs = knobs
        self.listen_host = listen_host
        self.listen_port = listen_port
        self.upstream_host = upstream_host
        self.upstream_port = upstream_port
        self.connections: set[Connection] = set()
        self.accepted_total = 0
        self.refused_total = 0
        self._server: asyncio.Server | None = None
        self._waiting: list[Connection] = []  # accepted during a partition
        self._probe: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, "link not started"
        return self._loop

    @property
    def upstream_down(self) -> bool:
        return self._probe is not None

    async def start(self) -> int:
        self._loop = asyncio.get_running_loop()
        await self._listen()
        return self.listen_port

    async def _listen(self) -> None:
        self._server = await self.loop.create_server(
            lambda: ClientSide(self.accepted), self.listen_host, self.listen_port,
            reuse_address=True, backlog=1024,
        )
        self.listen_port = int(self._server.sockets[0].getsockname()[1])

    def accepted(self, client: asyncio.Transport) -> Connection:
        conn = Connection(self.loop, self.knobs, client, self.connections)
        self.connections.add(conn)
        self.accepted_total += 1
        # The emulated handshake: the upstream is reached one RTT after the accept.
        self.loop.call_later(2 * conn.one_way_s, self._connect, conn)
        return conn

    def _connect(self, conn: Connection) -> None:
        if conn.closed:
            return
        if self.knobs.partition:
            self._waiting.append(conn)
            return
        task = self.loop.create_task(self._open_upstream(conn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _open_upstream(self, conn: Connection) -> None:
        try:
            await self.loop.create_connection(
                lambda: UpstreamSide(conn), self.upstream_host, self.upstream_port
            )
        except OSError:
            self.refused_total += 1
            conn.close_now(reset=True)
            self._upstream_refused()

    def _upstream_refused(self) -> None:
        """Mirror the engine: stop listening until it accepts connections again."""
        if self._probe is not None or self._server is None:
            return
        self._server.close()
        self._server = None
        self._probe = self.loop.create_task(self._wait_for_upstream())

    async def _wait_for_upstream(self) -> None:
        try:
            while True:
                await asyncio.sleep(UPSTREAM_PROBE_S)
                try:
                    _, writer = await asyncio.open_connection(self.upstream_host,
                                                              self.upstream_port)
                except OSError:
                    continue
                writer.close()
                try:
                    await self._listen()
                except OSError as exc:
                    log.warning("netem cannot listen again on %s:%d: %s",
                                self.listen_host, self.listen_port, exc)
                    continue
                log.info("netem %s:%d: upstream back, listening again",
                         self.listen_host, self.listen_port)
                return
        finally:
            self._probe = None

    def heal(self) -> None:
        """The partition ended: deliver what was held, connect what waited."""
        waiting, self._waiting = self._waiting, []
        for conn in waiting:
            self._connect(conn)
        for conn in list(self.connections):
            conn.to_upstream.arm()
            conn.to_client.arm()

    def refresh_delays(self) -> None:
        for conn in self.connections:
            conn.refresh_delay()

    def reset_all(self) -> int:
        conns = list(self.connections)
        for conn in conns:
            conn.close_now(reset=True)
        self._waiting.clear()
        return len(conns)

    async def stop(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe
        if self._server is not None:
            self._server.close()
            self._server = None
        for conn in list(self.connections):
            conn.close_now(reset=False)
        for task in list(self._tasks):
            task.cancel()

    def stats(self) -> dict[str, Any]:
        return {"listen": f"{self.listen_host}:{self.listen_port}",
                "upstream": f"{self.upstream_host}:{self.upstream_port}",
                "open": len(self.connections), "accepted": self.accepted_total,
                "refused_upstream": self.refused_total, "upstream_down": self.upstream_down}


class NetemRegion:
    """All links of one region, sharing its knobs."""

    def __init__(self, knobs: NetemKnobs, listen_host: str,
                 upstreams: Sequence[tuple[str, int]]) -> None:
        self.knobs = knobs
        self.links = [NetemLink(knobs, listen_host, host, port) for host, port in upstreams]

    async def start(self) -> list[int]:
        """Listen on one free port per upstream; returns them in the upstreams' order."""
        return [await link.start() for link in self.links]

    def set(self, *, extra_rtt_ms: float | None = None, partition: bool | None = None,
            rtt_ms: float | None = None) -> NetemKnobs:
        """Change the named knobs. New latency applies to data sent from now on."""
        if rtt_ms is not None:
            self.knobs.rtt_ms = rtt_ms
        if extra_rtt_ms is not None:
            self.knobs.extra_rtt_ms = extra_rtt_ms
        if rtt_ms is not None or extra_rtt_ms is not None:
            for link in self.links:
                link.refresh_delays()
        if partition is not None and partition != self.knobs.partition:
            self.knobs.partition = partition
            if not partition:
                for link in self.links:
                    link.heal()
        return self.knobs

    def reset(self) -> int:
        """Reset every open connection; returns how many."""
        return sum(link.reset_all() for link in self.links)

    async def stop(self) -> None:
        for link in self.links:
            await link.stop()

    def stats(self) -> dict[str, Any]:
        return {**self.knobs.describe(), "links": [link.stats() for link in self.links]}
