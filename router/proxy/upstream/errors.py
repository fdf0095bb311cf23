"""What the upstream client raises: its callers' errors, and a malformed answer's."""

from __future__ import annotations


class UpstreamError(Exception):
    """Base of the errors talking to an upstream worker."""


class ConnectFailed(UpstreamError):
    """The TCP connection could not be made: refused, unreachable, or timed out.

    No byte of the request left, so it is always safe to send it elsewhere.
    """


class ConnectionBroken(UpstreamError):
    """The connection closed or broke before the whole answer arrived.

    Also raised for an answer that cannot be parsed, is too large, or was closed by the
    caller. `stale` is True when the connection came from the pool and no byte of the
    answer arrived: the worker closed an idle keep-alive connection, the request was most
    likely never processed, and it is safe to resend it at once. `received_any` tells
    whether any byte of the answer arrived (if so, resending would repeat a processed
    request).
    """

    def __init__(self, message: str, *, stale: bool, received_any: bool) -> None:
        super().__init__(message)
        self.stale = stale
        self.received_any = received_any


class MalformedAnswer(Exception):
    """The answer breaks HTTP/1.1: the connection is dropped (the connection turns it into
    ConnectionBroken for its caller)."""
