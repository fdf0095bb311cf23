"""router.proxy.shares: when a process leaves the next connection to a sibling."""

from __future__ import annotations

from pathlib import Path

from router.proxy.shares import (
    RATIO,
    SLACK,
    ConnectionShares,
    create_shares,
    mark_not_accepting,
)


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
