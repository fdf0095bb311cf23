"""The emulated network proxy, on loopback: latency, order, partition, reset, dead upstream."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest

from lab.devstack.netem import NetemRegion
from lab.devstack.netem_knobs import NetemKnobs
from lab.devstack.valkey import free_port
from tests.conftest import within

HOST = "127.0.0.1"


class Echo:
    """An upstream that echoes every byte and records what it received."""

    def __init__(self) -> None:
        self.received = bytearray()
        self.connections = 0
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self, port: int = 0) -> None:
        self.server = await asyncio.start_server(self._handle, HOST, port, reuse_address=True)
        self.port = int(self.server.sockets[0].getsockname()[1])

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                self.received += data
                writer.write(data)
                await writer.drain()
        writer.close()

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


@pytest.fixture
async def echo() -> AsyncIterator[Echo]:
    server = Echo()
    await server.start()
    yield server
    with contextlib.suppress(Exception):
        await server.stop()


async def _region(echo: Echo, rtt_ms: float) -> NetemRegion:
    region = NetemRegion(NetemKnobs(rtt_ms=rtt_ms), HOST, [(HOST, echo.port)])
    await region.start()
    return region


async def _round_trip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      payload: bytes) -> float:
    started = time.monotonic()
    writer.write(payload)
    assert await within(reader.readexactly(len(payload)), 5) == payload
    return time.monotonic() - started


async def test_adds_the_rtt_and_a_handshake_to_new_connections(echo: Echo) -> None:
    region = await _region(echo, rtt_ms=100)
    try:
        started = time.monotonic()
        reader, writer = await asyncio.open_connection(HOST, region.links[0].listen_port)
        first = await _round_trip(reader, writer, b"hello")
        assert time.monotonic() - started >= 0.195  # handshake (1 RTT) + request and answer
        assert first < 0.5
        again = await _round_trip(reader, writer, b"again")
        assert 0.095 <= again < 0.3  # one RTT on an open connection
        writer.close()
    finally:
        await region.stop()


async def test_extra_rtt_applies_at_run_time(echo: Echo) -> None:
    region = await _region(echo, rtt_ms=0)
    try:
        reader, writer = await asyncio.open_connection(HOST, region.links[0].listen_port)
        assert await _round_trip(reader, writer, b"x") < 0.05
        region.set(extra_rtt_ms=200)
        assert 0.195 <= await _round_trip(reader, writer, b"y") < 0.45
        region.set(extra_rtt_ms=0)
        assert await _round_trip(reader, writer, b"z") < 0.05
        writer.close()
    finally:
        await region.stop()


async def test_order_is_kept_when_the_latency_drops_mid_stream(echo: Echo) -> None:
    region = await _region(echo, rtt_ms=200)
    try:
        reader, writer = await asyncio.open_connection(HOST, region.links[0].listen_port)
        chunks = [f"{i:05d};".encode() for i in range(400)]
        for index, chunk in enumerate(chunks):
            if index == 200:
                region.set(rtt_ms=0)  # later bytes must still not overtake earlier ones
            writer.write(chunk)
            if index % 50 == 0:
                await asyncio.sleep(0.005)
        expected = b"".join(chunks)
        assert await within(reader.readexactly(len(expected)), 5) == expected
        assert bytes(echo.received) == expected
        writer.close()
    finally:
        await region.stop()


async def test_partition_blackholes_then_heals(echo: Echo) -> None:
    region = await _region(echo, rtt_ms=10)
    try:
        reader, writer = await asyncio.open_connection(HOST, region.links[0].listen_port)
        await _round_trip(reader, writer, b"before")
        region.set(partition=True)
        writer.write(b"during")
        # A new connection is accepted (as the kernel would) but nothing gets through.
        async with asyncio.timeout(1):
            reader2, writer2 = await asyncio.open_connection(HOST, region.links[0].listen_port)
        writer2.write(b"new")
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.4):
                await reader.read(100)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.1):
                await reader2.read(100)
        assert bytes(echo.received) == b"before"
        region.set(partition=False)
        assert await within(reader.readexactly(6), 2) == b"during"
        assert await within(reader2.readexactly(3), 2) == b"new"
        writer.close()
        writer2.close()
    finally:
        await region.stop()


async def test_reset_resets_open_connections(echo: Echo) -> None:
    region = await _region(echo, rtt_ms=0)
    try:
        reader, writer = await asyncio.open_connection(HOST, region.links[0].listen_port)
        await _round_trip(reader, writer, b"ping")
        assert region.reset() == 1
        with pytest.raises(ConnectionResetError):
            async with asyncio.timeout(2):
                await reader.read(100)
    finally:
        await region.stop()


async def test_a_dead_upstream_is_refused_until_it_is_back() -> None:
    echo = Echo()
    port = free_port(HOST)
    region = NetemRegion(NetemKnobs(rtt_ms=0), HOST, [(HOST, port)])
    await region.start()
    listen_port = region.links[0].listen_port
    try:
        # Nothing listens upstream: the first connection is reset, the next ones refused.
        reader, writer = await asyncio.open_connection(HOST, listen_port)
        writer.write(b"hello")
        with contextlib.suppress(ConnectionError):
            assert await within(reader.read(100), 2) == b""
        await asyncio.sleep(0.05)
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection(HOST, listen_port)
        await echo.start(port)
        deadline = time.monotonic() + 3
        while True:
            try:
                reader, writer = await asyncio.open_connection(HOST, listen_port)
                break
            except ConnectionRefusedError:
                assert time.monotonic() < deadline, "the proxy did not listen again"
                await asyncio.sleep(0.02)
        assert await _round_trip(reader, writer, b"back") < 1
        writer.close()
    finally:
        await region.stop()
        with contextlib.suppress(Exception):
            await echo.stop()


def test_rtt_by_source_address() -> None:
    knobs = NetemKnobs(rtt_ms=80, extra_rtt_ms=20, rtt_ms_by_source={"127.0.2.1": 0})
    assert knobs.one_way_s("127.0.0.1") == pytest.approx(0.05)
    assert knobs.one_way_s("127.0.2.1") == pytest.approx(0.01)
