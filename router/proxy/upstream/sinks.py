"""What a connection talks to besides its socket: the sink its body is piped to, and the
pool that keeps it between requests."""

from __future__ import annotations

import typing

_Connection = typing.TypeVar("_Connection", contravariant=True)


class Sink(typing.Protocol):
    """Where `UpstreamConnection.pipe` writes decoded body bytes (e.g. a client transport)."""

    def write(self, data: bytes) -> None: ...


class FramingSink(Sink, typing.Protocol):
    """A sink that sends chunked framing itself: a read that holds whole chunks of a
    chunked answer and nothing else is handed over as it came, frames and all, to
    `write_frame` (no decoding, no re-encoding: a streamed token's usual path)."""

    def write_frame(self, frame: bytes) -> None: ...


class ConnectionKeeper(typing.Protocol[_Connection]):
    """What a connection tells the pool that keeps it (`pool.UpstreamPool`)."""

    def park(self, connection: _Connection) -> None:
        """Released with its whole answer read and reusable: idle from now (or closed)."""

    def forget(self, connection: _Connection) -> None:
        """A parked (idle) connection closed: out of the idle ones."""

    def lost(self, connection: _Connection) -> None:
        """The connection's transport is gone."""
