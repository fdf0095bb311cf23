"""`free_port` never hands out a port promised to a process that has not started listening."""

from __future__ import annotations

import socket
import types
from typing import Any

import pytest

from lab.devstack import valkey
from lab.devstack.valkey import EmbeddedRedisError, free_port


class _ScriptedSocket:
    """A socket whose bind to port 0 lands on the next port of a script, as the kernel's
    choice would: a port that was free a moment ago may be handed out again."""

    def __init__(self, ports: list[int]) -> None:
        self._ports = ports
        self._port = 0

    def __enter__(self) -> _ScriptedSocket:
        return self

    def __exit__(self, *_exc: object) -> None:
        return None

    def bind(self, address: tuple[str, int]) -> None:
        assert address[1] == 0
        self._port = self._ports.pop(0)

    def getsockname(self) -> tuple[str, int]:
        return ("127.0.0.1", self._port)


def _kernel_hands_out(monkeypatch: pytest.MonkeyPatch, ports: list[int]) -> None:
    fake: Any = types.SimpleNamespace(
        AF_INET=socket.AF_INET, SOCK_STREAM=socket.SOCK_STREAM,
        socket=lambda *_args: _ScriptedSocket(ports))
    monkeypatch.setattr(valkey, "socket", fake)


def test_a_port_promised_elsewhere_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    _kernel_hands_out(monkeypatch, [8080, 8080, 41000])
    assert free_port("127.0.0.1", avoid=(8080,)) == 41000


def test_without_anything_to_avoid_the_first_free_port_is_taken(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _kernel_hands_out(monkeypatch, [8080])
    assert free_port("127.0.0.1") == 8080


def test_a_kernel_that_only_offers_promised_ports_is_a_clear_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _kernel_hands_out(monkeypatch, [8080] * 100)
    with pytest.raises(EmbeddedRedisError, match=r"no free port on 127\.0\.0\.1 outside \[8080\]"):
        free_port("127.0.0.1", avoid=(8080,))


def test_a_real_free_port_can_be_listened_on() -> None:
    port = free_port("127.0.0.1")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
        sock.listen()
