"""One client request as the proxy sees it, whichever server received it.

Inference requests arrive through the router's own HTTP/1.1 front (`router.proxy.front`,
the fast path) or through aiohttp's server (connections the front hands over, and test
apps). Both give the proxy an `Exchange`: the request's head and body, and a way to
send a streamed answer. Whole answers go back as a `Reply`, which each server writes its
own way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from aiohttp import web
from aiohttp.http_exceptions import (
    ContentEncodingError,
    ContentLengthError,
    DecompressSizeError,
    HttpProcessingError,
    LineTooLong,
    TransferEncodingError,
)

from router.core.errors import ApiError, error_body
from router.proxy.transcript import Transcript
from router.proxy.upstream.connection import UpstreamConnection
from router.proxy.upstream.errors import UpstreamError

# After the host stalled this process, the loop runs expired timers before it reads the
# sockets (libuv: timers, then I/O): what arrived during the stall is not seen yet. A
# timeout looks again after one more read of the sockets, this long, before it is final.
STALL_GRACE_S = 0.05


@dataclass(slots=True)
class Reply:
    """An answer for the client. `streamed`: already sent through `Exchange.relay`."""

    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    streamed: bool = False


def error_reply(
    status: int,
    message: str,
    *,
    code: str | None = None,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> Reply:
    """An OpenAI-format JSON error, as `router.core.errors.error_response` writes it."""
    return Reply(status, {**(headers or {}), "Content-Type": "application/json"},
                 error_body(status, message, code=code, param=param))


def api_error_reply(exc: ApiError) -> Reply:
    return error_reply(exc.status, exc.message, code=exc.code, param=exc.param,
                       headers=exc.headers)


class Exchange(Protocol):
    """The client side of one request."""

    paced: bool  # sent by the router itself at its own pace (a batch line), not a client

    @property
    def path(self) -> str: ...

    @property
    def headers(self) -> Mapping[str, str]:
        """Request headers; looked up by lower-case name."""

    @property
    def content_length(self) -> int | None: ...

    def body_if_here(self) -> bytes | None:
        """The whole body if it has all arrived (taken: do not read it again), else None
        (then `read_body`). Spares the usual request, whose body came with its head, an
        await."""

    async def read_body(self, timeout_s: float) -> bytes:
        """The whole body; ApiError(408) when it does not arrive within `timeout_s`."""

    async def relay(
        self, headers: Mapping[str, str], first: bytes, upstream: UpstreamConnection,
        transcript: Transcript | None = None,
    ) -> UpstreamError | None:
        """Start a 200 event stream with `headers` and `first`, then pass the rest of
        `upstream`'s body through as it arrives (through `transcript.admit`, if given).
        Returns None when the body ended, or the error that broke it off (the stream
        stays open for `end_stream`). Raises ConnectionError or CancelledError when the
        client went away."""

    async def relay_more(
        self, first: bytes, upstream: UpstreamConnection, rewrite: Callable[[bytes], bytes]
    ) -> UpstreamError | None:
        """Go on with a started stream: `first`, then `upstream`'s body through
        `rewrite` (another worker's continuation of the answer). Returns and raises as
        `relay` does."""

    async def end_stream(self, tail: bytes, server_timing: str | None = None) -> None:
        """Write `tail` (maybe empty) and end the stream; `server_timing`, if given, as
        a `server-timing` trailer where the server can send one (the front can; aiohttp's
        server cannot, and drops it)."""

    def client_pending_bytes(self) -> int:
        """Bytes written for the client that it has not taken yet (the transport's write
        buffer): falling while it reads, standing still while it stalls."""

    def abort_client(self) -> None:
        """Cut the client's connection now (a client that stopped reading): its request
        is then cancelled as if it had gone away."""


InferenceHandler = Callable[[Exchange], Awaitable[Reply]]

# The Content-Encodings of request bodies that aiohttp's server inflates (br and zstd when
# their libraries are installed; without them its parser refuses the head, 400).
DECODED_ENCODINGS = frozenset({"identity", "gzip", "x-gzip", "deflate", "br", "zstd"})
# The error code of a body that cannot be read to its end: its connection is closed.
MALFORMED_BODY = "malformed_body"


async def read_whole(request: web.Request) -> bytes:
    """The whole (inflated) body of a request aiohttp's server received. ApiError(413) past
    `client_max_size` (router.max_body_bytes; aiohttp inflates no further), ApiError(400,
    code "malformed_body") for a body its framing or compression breaks."""
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, "request body is too large (limit "
                       f"{request.client_max_size} bytes, once inflated)") from None
    except (web.RequestPayloadError, HttpProcessingError) as exc:
        cause = exc.__cause__ if isinstance(exc, web.RequestPayloadError) else exc
        request.content.feed_eof()  # nothing more to read: aiohttp does not linger on it
        raise ApiError(400, f"the request body is malformed: {_payload_fault(cause)}",
                       code=MALFORMED_BODY) from None


def _payload_fault(exc: BaseException | None) -> str:
    """What broke a request body, in the router's words (aiohttp's quote client bytes)."""
    if isinstance(exc, (ContentEncodingError, DecompressSizeError)):
        return "its compressed data does not inflate"
    if isinstance(exc, (TransferEncodingError, LineTooLong)):
        return "its chunked framing is invalid"
    if isinstance(exc, ContentLengthError):
        return "it is shorter than its Content-Length"
    return "it cannot be read"


class AiohttpExchange:
    """An inference request that aiohttp's server received (handed-over connections)."""

    __slots__ = ("_broken", "_request", "response")
    paced = False

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self.response: web.StreamResponse | None = None
        self._broken = False  # its body's framing broke: the connection is closed after

    @property
    def path(self) -> str:
        return self._request.path

    @property
    def headers(self) -> Mapping[str, str]:
        return self._request.headers  # case-insensitive

    @property
    def content_length(self) -> int | None:
        return self._request.content_length

    def body_if_here(self) -> bytes | None:
        return None  # aiohttp reads it only in a coroutine

    async def read_body(self, timeout_s: float) -> bytes:
        request = self._request
        encoding = request.headers.get("Content-Encoding")
        if encoding is not None and encoding.lower() not in DECODED_ENCODINGS:
            raise ApiError(415, "unsupported Content-Encoding: send the body as identity, "
                           "gzip or deflate")
        if request.content.is_eof():
            return await self._read_whole()  # already all here: nothing to time out
        # One read, waited for twice (see STALL_GRACE_S): cancelling it would lose the
        # part it read.
        reading = asyncio.ensure_future(self._read_whole())
        done, _ = await asyncio.wait((reading,), timeout=timeout_s)
        if not done:
            done, _ = await asyncio.wait((reading,), timeout=STALL_GRACE_S)
        if not done:
            reading.cancel()
            raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s")
        return reading.result()

    async def _read_whole(self) -> bytes:
        try:
            return await read_whole(self._request)
        except ApiError as exc:
            self._broken = exc.code == MALFORMED_BODY  # nothing after it can be read
            raise

    async def relay(
        self, headers: Mapping[str, str], first: bytes, upstream: UpstreamConnection,
        transcript: Transcript | None = None,
    ) -> UpstreamError | None:
        response = self.response = web.StreamResponse(status=200, headers=headers)
        await response.prepare(self._request)
        return await self._pass(first, upstream, None if transcript is None else transcript.admit,
                                transcript)

    async def relay_more(
        self, first: bytes, upstream: UpstreamConnection, rewrite: Callable[[bytes], bytes]
    ) -> UpstreamError | None:
        return await self._pass(first, upstream, rewrite, None)

    async def _pass(self, first: bytes, upstream: UpstreamConnection,
                    change: Callable[[bytes], bytes] | None, transcript: Transcript | None
                    ) -> UpstreamError | None:
        response = self.response
        assert response is not None
        try:
            if change is not None:
                first = change(first)
            if first:
                await response.write(first)
            while True:
                chunk = await upstream.read_some()
                if not chunk:
                    break
                if change is not None:
                    chunk = change(chunk)
                if chunk:
                    await response.write(chunk)
            if transcript is not None:
                tail = transcript.take_held()  # raises if the body ended inside an event
                if tail:
                    await response.write(tail)
        except UpstreamError as exc:
            return exc
        return None

    async def end_stream(self, tail: bytes, server_timing: str | None = None) -> None:
        assert self.response is not None
        if tail:
            await self.response.write(tail)
        await self.response.write_eof()

    def client_pending_bytes(self) -> int:
        transport = self._request.transport
        return 0 if transport is None else transport.get_write_buffer_size()

    def abort_client(self) -> None:
        transport = self._request.transport
        if transport is not None:
            transport.abort()

    def answer(self, reply: Reply) -> web.StreamResponse:
        """The aiohttp response for `reply`."""
        if reply.streamed:
            assert self.response is not None
            return self.response
        response = web.Response(status=reply.status, body=reply.body, headers=reply.headers)
        if self._broken:
            response.force_close()  # its framing is broken: nothing after it can be read
        return response
