"""The client behaviours of the hostile drill, registered by name (see
lab.drill.hostile.clients for what a behaviour is)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time
from typing import Any

from lab.drill.hostile.clients import (
    ClientBehaviour,
    ClientSettings,
    Outcome,
    Pace,
    RequestPlan,
    ensure_open_files,
    read_body,
)
from lab.drill.hostile.http import Endpoint, Head, post_bytes, post_head, read_head

_BIG_BODY_PIECE_BYTES = 256 * 1024
_IDLE_CONNECTS_AT_ONCE = 100  # below the router's listen backlog (aiohttp's 128)
_IDLE_CONNECT_TIMEOUT_S = 5.0


class Normal(ClientBehaviour):
    name = "normal"


class SlowReader(ClientBehaviour):
    """Reads a long stream at 1 KB/s for `slow_read_s`, then the rest at once: the router
    must pause the worker meanwhile without counting the silence against it."""

    name = "slow_reader"

    def tokens(self, plan: RequestPlan) -> int:
        return self.settings.long_stream_tokens if plan.stream else self.settings.tokens

    async def read(self, reader: asyncio.StreamReader, head: Head, first: bytes,
                   outcome: Outcome) -> None:
        pace = Pace(self.settings.slow_read_bytes_per_s, self.settings.slow_read_s)
        await read_body(reader, head, first, outcome, pace=pace)


class ReadsThenStalls(ClientBehaviour):
    """Reads the head and a few events of a long stream (the head of a whole answer),
    then reads nothing for `stall_s` with the connection open, then closes it."""

    name = "reads_then_stalls"
    expects = "partial"

    def tokens(self, plan: RequestPlan) -> int:
        return self.settings.long_stream_tokens if plan.stream else self.settings.tokens

    async def read(self, reader: asyncio.StreamReader, head: Head, first: bytes,
                   outcome: Outcome) -> None:
        if outcome.plan.stream:
            await read_body(reader, head, first, outcome,
                            enough_events=self.settings.stall_after_events)

    def hold_s(self) -> float:
        return self.settings.stall_s


class DisconnectsBeforeHeaders(ClientBehaviour):
    """Sends the request and closes the connection at once."""

    name = "disconnects_before_headers"
    expects = "nothing"

    async def exchange(self, endpoint: Endpoint, plan: RequestPlan,
                       reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                       outcome: Outcome) -> None:
        writer.write(post_bytes(endpoint, plan.path, self.body(plan)))
        await writer.drain()


class DisconnectsAfterHeaders(ClientBehaviour):
    """Reads the head, then closes the connection."""

    name = "disconnects_after_headers"
    expects = "head"

    async def read(self, reader: asyncio.StreamReader, head: Head, first: bytes,
                   outcome: Outcome) -> None:
        return  # the head is all it wanted


class DisconnectsMidStream(ClientBehaviour):
    """Reads the head and a few events (half of a whole answer), then closes."""

    name = "disconnects_mid_stream"
    expects = "partial"

    async def read(self, reader: asyncio.StreamReader, head: Head, first: bytes,
                   outcome: Outcome) -> None:
        length = head.content_length
        stream = outcome.plan.stream
        await read_body(reader, head, first, outcome,
                        enough_events=self.settings.stall_after_events if stream else None,
                        enough_bytes=None if length is None else max(1, length // 2))


class BigBody(ClientBehaviour):
    """Sends a 10 MB body (over the router's max_body_bytes) and expects a 413."""

    name = "big_body"
    expects = "refusal"

    async def exchange(self, endpoint: Endpoint, plan: RequestPlan,
                       reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                       outcome: Outcome) -> None:
        size = self.settings.big_body_bytes
        writer.write(post_head(endpoint, plan.path, size))
        sending = asyncio.create_task(_send_filler(writer, size))
        try:
            head, _ = await read_head(reader)
        finally:
            sending.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sending
        outcome.took_head(head)


async def _send_filler(writer: asyncio.StreamWriter, size: int) -> None:
    """A JSON-ish body of `size` bytes, as fast as the router takes it (it may close first)."""
    piece = b" " * _BIG_BODY_PIECE_BYTES
    with contextlib.suppress(OSError):
        for _ in range(size // len(piece)):
            writer.write(piece)
            await writer.drain()


class IdleConnections(ClientBehaviour):
    """`idle_connections` open connections that never send a byte, opened before the
    cell's (normal) requests and reset after them."""

    name = "idle_connections"

    def __init__(self, settings: ClientSettings) -> None:
        super().__init__(settings)
        self._sockets: list[socket.socket] = []
        self._facts: dict[str, Any] = {}

    async def open(self, endpoint: Endpoint) -> None:
        wanted = self.settings.idle_connections
        ensure_open_files(wanted + 1000)
        gate = asyncio.Semaphore(_IDLE_CONNECTS_AT_ONCE)
        started = time.monotonic()
        results = await asyncio.gather(*(self._open_one(endpoint, gate) for _ in range(wanted)),
                                       return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        self._facts = {"wanted": wanted, "opened": len(self._sockets),
                       "failed": len(failures), "open_s": round(time.monotonic() - started, 2),
                       "first_failure": repr(failures[0]) if failures else None}

    async def _open_one(self, endpoint: Endpoint, gate: asyncio.Semaphore) -> None:
        async with gate:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                async with asyncio.timeout(_IDLE_CONNECT_TIMEOUT_S):
                    await asyncio.get_running_loop().sock_connect(
                        sock, (endpoint.host, endpoint.port))
            except BaseException:
                sock.close()
                raise
            self._sockets.append(sock)

    async def close(self) -> None:
        self._facts["open_at_end"] = sum(_still_open(sock) for sock in self._sockets)
        for sock in self._sockets:
            # RST, not FIN: no TIME_WAIT left behind for 10,000 ports per cell.
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        self._sockets.clear()

    def cell_facts(self) -> dict[str, Any]:
        return {"idle_connections": dict(self._facts)}


def _still_open(sock: socket.socket) -> bool:
    """Whether the router has kept this connection open (no FIN or RST from it)."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


# Every behaviour by name (they register themselves as their classes are defined above).
BEHAVIOURS = ClientBehaviour.registry
