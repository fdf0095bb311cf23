"""The data path of the emulated network: one accepted connection and its upstream twin.

Each direction is a `Flow`: bytes (and end-of-stream signals) are queued with the time
they are due and written in order when due, one timer per burst. See lab.devstack.netem
for the knobs and the listening side.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections import deque
from collections.abc import Callable
from typing import cast

from lab.devstack.netem_knobs import NetemKnobs

# Bytes held in one direction before reading from its source pauses (a TCP window).
HELD_LIMIT_BYTES = 1 << 20
# Chunks due within this much of now go out in the same write.
_COALESCE_S = 0.0005


class Signal:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


EOF = Signal("eof")  # half-close: the source will send no more
CLOSE = Signal("close")  # the source closed cleanly: close after the data before it
RESET = Signal("reset")  # the source was reset: reset the other side too

Item = bytes | Signal


def reset_transport(transport: asyncio.BaseTransport | None) -> None:
    """Close with RST (SO_LINGER 0), as a killed or partition-timed-out peer would."""
    if transport is None or transport.is_closing():
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    cast(asyncio.Transport, transport).abort()


def set_nodelay(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class Flow:
    """One direction of one connection: items delivered to `target` when due, in order."""

    __slots__ = ("_conn", "_held_bytes", "_items", "_last_due", "_loop", "_timer",
                 "queue_full", "source", "target", "target_full")

    def __init__(self, conn: Connection, loop: asyncio.AbstractEventLoop) -> None:
        self._conn = conn
        self._loop = loop
        self._items: deque[tuple[float, Item]] = deque()
        self._timer: asyncio.TimerHandle | None = None
        self._last_due = 0.0
        self._held_bytes = 0
        self.source: asyncio.Transport | None = None
        self.target: asyncio.Transport | None = None
        self.queue_full = False
        self.target_full = False

    def push(self, item: Item, not_before: float = 0.0) -> None:
        conn = self._conn
        due = max(self._loop.time() + conn.one_way_s, not_before, self._last_due)
        self._last_due = due
        self._items.append((due, item))
        if isinstance(item, bytes):
            self._held_bytes += len(item)
            if self._held_bytes > HELD_LIMIT_BYTES and not self.queue_full:
                self.queue_full = True
                self._update_source()
        if self._timer is None:
            self.arm()

    def arm(self) -> None:
        """(Re)schedule delivery of the first item, unless blocked."""
        if self._timer is not None or not self._items or self.target is None:
            return
        if self._conn.knobs.partition:
            return  # held until the partition heals (NetemLink.heal re-arms)
        self._timer = self._loop.call_at(self._items[0][0], self._fire)

    def _fire(self) -> None:
        self._timer = None
        target = self.target
        if target is None or self._conn.knobs.partition:
            return
        horizon = self._loop.time() + _COALESCE_S
        items = self._items
        chunks: list[bytes] = []
        signal: Signal | None = None
        while items and items[0][0] <= horizon:
            _, item = items.popleft()
            if isinstance(item, bytes):
                chunks.append(item)
            else:
                signal = item
                break
        if chunks:
            data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            self._held_bytes -= len(data)
            if not target.is_closing():
                target.write(data)
            if self.queue_full and self._held_bytes <= HELD_LIMIT_BYTES // 2:
                self.queue_full = False
                self._update_source()
        if signal is not None:
            self._deliver(signal, target)
        if items:
            self.arm()

    def _deliver(self, signal: Signal, target: asyncio.Transport) -> None:
        if signal is EOF:
            if target.can_write_eof() and not target.is_closing():
                with contextlib.suppress(OSError, RuntimeError):
                    target.write_eof()
        elif signal is CLOSE:
            target.close()
        else:
            reset_transport(target)

    def _update_source(self) -> None:
        source = self.source
        if source is None or source.is_closing():
            return
        if self.queue_full or self.target_full:
            source.pause_reading()
        else:
            source.resume_reading()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._items.clear()


class Connection:
    """A client connection and its upstream twin."""

    __slots__ = ("accepted_at", "client", "closed", "knobs", "link_connections", "one_way_s",
                 "to_client", "to_upstream", "upstream")

    def __init__(self, loop: asyncio.AbstractEventLoop, knobs: NetemKnobs,
                 client: asyncio.Transport, link_connections: set[Connection]) -> None:
        self.knobs = knobs
        # The open connections of this one's link (NetemLink), which it leaves when closed.
        self.link_connections = link_connections
        self.client = client
        self.upstream: asyncio.Transport | None = None
        self.closed = False
        peer = client.get_extra_info("peername")
        self.one_way_s = self.knobs.one_way_s(peer[0] if peer else "")
        self.accepted_at = loop.time()
        self.to_upstream = Flow(self, loop)
        self.to_client = Flow(self, loop)
        self.to_upstream.source = client
        self.to_client.target = client

    def refresh_delay(self) -> None:
        peer = self.client.get_extra_info("peername")
        self.one_way_s = self.knobs.one_way_s(peer[0] if peer else "")

    def from_client(self, item: Item) -> None:
        # The client may send before the emulated handshake is over; its bytes cannot
        # arrive before handshake (one RTT) + half an RTT.
        self.to_upstream.push(item, self.accepted_at + 3 * self.one_way_s)

    def upstream_connected(self, upstream: asyncio.Transport) -> None:
        if self.closed:
            upstream.close()
            return
        set_nodelay(upstream)
        self.upstream = upstream
        self.to_upstream.target = upstream
        self.to_client.source = upstream
        self.to_upstream.arm()

    def close_now(self, *, reset: bool) -> None:
        """Both sides, at once (knob `reset`, upstream refused, or proxy stopping)."""
        if self.closed:
            return
        self.closed = True
        self.to_upstream.cancel()
        self.to_client.cancel()
        for transport in (self.client, self.upstream):
            if reset:
                reset_transport(transport)
            elif transport is not None:
                transport.close()
        self.link_connections.discard(self)


class ClientSide(asyncio.Protocol):
    def __init__(self, accepted: Callable[[asyncio.Transport], Connection]) -> None:
        self._accepted = accepted  # the link's: a Connection for a newly accepted client
        self._conn: Connection | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not subclasses of asyncio.Transport, only look alike.
        set_nodelay(transport)
        self._conn = self._accepted(cast(asyncio.Transport, transport))

    def data_received(self, data: bytes) -> None:
        assert self._conn is not None
        self._conn.from_client(data)

    def eof_received(self) -> bool:
        assert self._conn is not None
        self._conn.from_client(EOF)
        return True  # keep the transport open for the answer

    def connection_lost(self, exc: Exception | None) -> None:
        conn = self._conn
        if conn is None or conn.closed:
            return
        conn.from_client(RESET if exc is not None else CLOSE)
        conn.link_connections.discard(conn)

    def pause_writing(self) -> None:
        if self._conn is not None:
            self._conn.to_client.target_full = True
            self._conn.to_client._update_source()

    def resume_writing(self) -> None:
        if self._conn is not None:
            self._conn.to_client.target_full = False
            self._conn.to_client._update_source()


class UpstreamSide(asyncio.Protocol):
    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._conn.upstream_connected(cast(asyncio.Transport, transport))

    def data_received(self, data: bytes) -> None:
        self._conn.to_client.push(data)

    def eof_received(self) -> bool:
        self._conn.to_client.push(EOF)
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._conn.closed:
            self._conn.to_client.push(RESET if exc is not None else CLOSE)

    def pause_writing(self) -> None:
        self._conn.to_upstream.target_full = True
        self._conn.to_upstream._update_source()

    def resume_writing(self) -> None:
        self._conn.to_upstream.target_full = False
        self._conn.to_upstream._update_source()
