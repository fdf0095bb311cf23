"""router.proxy.shares: when a process leaves the next connection to a sibling."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import cast

from aiohttp import web

from router.proxy.exchange import InferenceHandler
from router.proxy.shares import (
    RATIO,
    SLACK,
    ConnectionShares,
    accepting,
    create_shares,
    mark_not_accepting,
)
from router.proxy.site import FrontSite


def test_a_process_defers_to_an_accepting_sibling_with_fewer_connections(
        tmp_path: Path) -> None:
    path = tmp_path / "connections"
    create_shares(path, 3)
    first, second = ConnectionShares(path, 0), ConnectionShares(path, 1)
    try:
        first.set_open(5)
        assert not first.over_share()  # nobody else accepts yet (index 2 never started)
        second.set_open(5 - SLACK - 1)
        assert first.over_share() and not second.over_share()
        second.set_open(5 - SLACK)
        assert not first.over_share()  # within the slack
        first.set_open(40)
        second.set_open(40 - 8)  # 8 more, but within a quarter: one per request traffic
        assert not first.over_share()
        second.set_open(int(40 / RATIO) - 1)
        assert first.over_share()
        first.set_open(5)
        second.set_open(0)
        mark_not_accepting(path, 1)  # exited: the supervisor says so
        assert not first.over_share()
        second.set_open(0)
        second.stop_accepting()  # stopping
        assert not first.over_share()
    finally:
        first.close()
        second.close()


async def test_a_site_on_a_shared_socket_has_started_only_once_its_siblings_see_it_accept(
        tmp_path: Path) -> None:
    # The router logs "router listening on" when its site has started, and the tests and
    # operators then send traffic. Were its slot still "not accepting" then, a sibling
    # would take a whole burst of keep-alive connections without deferring once: the
    # compiled tier once saw [320, 0] requests per process.
    path = tmp_path / "connections"
    create_shares(path, 2)
    listener = socket.create_server(("127.0.0.1", 0))
    runner = web.AppRunner(web.Application())
    await runner.setup()
    # (No request is served here: the handler is never reached.)
    site = FrontSite(runner, None, None, handler=cast(InferenceHandler, None),
                     header_timeout_s=5.0, sock=listener,
                     shares=ConnectionShares(path, 1))
    try:
        await site.start()
        assert accepting(path, 1)
        assert not accepting(path, 0)  # (the sibling never started)
        # ... and it takes a connection.
        _reader, writer = await asyncio.open_connection(*listener.getsockname()[:2])
        for _ in range(100):
            if site.connections:
                break
            await asyncio.sleep(0.01)
        assert len(site.connections) == 1
        writer.close()
    finally:
        await site.stop()
        await runner.cleanup()
    assert not accepting(path, 1)  # stopped: its siblings take everything again
