"""`globalpool status` never prints a control or bidi character as it is
(router.admin.terminal): worker ids, drain reasons and refused files come from elsewhere."""

from __future__ import annotations

from typing import Any

import pytest

from router.admin.table import render
from router.admin.terminal import escape, escape_all, first_unsafe

HOSTILE = "disk \u202e\u0007\u001b[2J\u0000\u0085\u2066 swap\nnext"


def _unsafe(text: str) -> list[str]:
    return [c for c in text if (ord(c) < 32 and c != "\n") or 0x7F <= ord(c) < 0xA0
            or c in "\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"]


@pytest.mark.parametrize("char", ["\x00", "\x1b", "\x7f", "\x85", "\x9f", "\u061c", "\u200e",
                                  "\u200f", "\u202a", "\u202e", "\u2066", "\u2069", "\n"])
def test_every_control_and_bidi_character_is_found_and_escaped(char: str) -> None:
    assert first_unsafe(f"ok {char} ok") == char
    assert not _unsafe(escape(f"ok {char} ok")) and "\n" not in escape(char)


def test_printable_text_is_left_alone() -> None:
    text = "eu-west: Zürich, 東京, emoji \U0001f680, zero-width joiner \u200d"
    assert first_unsafe(text) is None and escape(text) is text
    assert escape(HOSTILE) == "disk \\u202e\\x07\\x1b[2J\\x00\\x85\\u2066 swap\\x0anext"
    assert escape_all({"k\x1b": ["v\x07", 3, None]}) == {"k\\x1b": ["v\\x07", 3, None]}


def _status() -> dict[str, Any]:
    worker: dict[str, Any] = {
        "id": f"w{HOSTILE}", "region": "us-east", "status": "ready",
        "load": {"running": 1, "waiting": 0, "kv_cache_usage": 0.1, "router_inflight": 1},
        "capacity": {"max_num_seqs": 8}, "performance": {"ttft_ms": 40.0},
        "heartbeat_age_s": 0.5}
    region: dict[str, Any] = {
        "name": f"us-east{HOSTILE}", "health": "ok", "workers": {f"ready{HOSTILE}": 1},
        "load_seqs": 1, "capacity_seqs": 8, "kv_cache_usage": 0.1, "traffic": None}
    return {
        "router": {"region": f"us-east{HOSTILE}", "now_unix_s": 1_700_000_000.0},
        "config": {"version": "abc", "last_error": {
            "at_unix_s": 1_700_000_000.0, "problems": [f"r.yaml: regions.{HOSTILE}: unknown"]}},
        "redis": {"connected": True, "snapshot_age_s": 0.1},
        "regions": [region], "workers": [worker],
        "drains": [{"kind": "worker", "name": f"w{HOSTILE}", "since_unix_s": 1_700_000_000.0,
                    "reason": HOSTILE, "by": "127.0.0.1"}],
    }


def test_render_escapes_every_string_of_the_status() -> None:
    table = render(_status())
    assert not _unsafe(table), repr(table)
    assert "disk \\u202e\\x07\\x1b[2J" in table
    assert not any(line.startswith("next") for line in table.splitlines())  # no forged row


def test_a_worker_whose_engine_is_stuck_says_so_in_the_table() -> None:
    status = _status()
    worker = status["workers"][0]
    assert " (engine stuck)" not in render(status)  # (no "engine" at all: an older router)
    worker["status"], worker["engine"] = "ejected", {"kind": "vllm", "stuck_for_s": 15.0}
    row = next(line for line in render(status).splitlines() if line.startswith("w"))
    assert "ejected (engine stuck)" in row, row
    worker["engine"]["stuck_for_s"] = None
    assert " (engine stuck)" not in render(status)
