"""One upstream attempt: send the client's bytes to a worker, pass the answer back.

Timeouts are split by phase (see `router.config.Timeouts`):
- connect: TCP connect to the worker (aiohttp's `sock_connect`);
- first byte: request sent -> response headers and, for streams, the first body chunk.
  For non-streaming requests the engine answers only when generation is done, so that
  phase is bounded by `total_s` instead;
- idle: the longest gap between two chunks of a stream once it has started;
- total: the whole attempt.

Nothing reaches the client before the upstream's first body chunk, so any failure up to
then raises `UpstreamFailure` and the caller may retry elsewhere; that includes a first
chunk that is a 5xx/429 error event. After it, the stream belongs to the client: a
failure ends it with an SSE error event.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Mapping

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from router.config import GlobalConfig, Timeouts
from router.proxy.errors import sse_error_event
from router.proxy.outcome import Attempt, Failure

# Request headers passed to workers. Everything else (Authorization, cookies, hop-by-hop
# headers, Host, Content-Length) stays at the router.
FORWARDED_REQUEST_HEADERS = ("content-type", "accept", "traceparent", "tracestate", "x-request-id")


# Sends retried at once when the connection breaks before any answer: each broken pooled
# connection is dropped, so the last try is usually a new connection.
STALE_CONNECTION_RETRIES = 2


class UpstreamFailure(Exception):
    """An attempt failed before anything reached the client; safe to retry elsewhere."""

    def __init__(
        self,
        message: str,
        kind: Failure,
        *,
        status: int = 502,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.kind = kind
        self.status = status
        self.retry_after_s = retry_after_s


class _IdleWatchdog:
    """Closes an upstream stream that stalls for `idle_s` or runs past `total_s`.

    Per chunk the proxy only stores the loop time; a timer that wakes every fraction of
    `idle_s` compares. That keeps the per-chunk cost to one clock read instead of
    re-arming a timeout for every chunk.
    """

    __slots__ = ("_deadline", "_handle", "_idle_s", "_loop", "_response", "fired", "last_s")

    def __init__(self, response: aiohttp.ClientResponse, idle_s: float, total_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._response = response
        self._idle_s = idle_s
        self.last_s = self._loop.time()
        self._deadline = self.last_s + total_s
        self.fired: str | None = None
        self._handle = self._loop.call_later(min(idle_s, total_s) / 4, self._check)

    def _check(self) -> None:
        now = self._loop.time()
        if now - self.last_s >= self._idle_s:
            self.fired = f"no data from the worker for {self._idle_s:g} s"
        elif now >= self._deadline:
            self.fired = "the request ran past its total timeout"
        if self.fired is not None:
            self._response.close()
            return
        self._handle = self._loop.call_later(self._idle_s / 4, self._check)

    def cancel(self) -> None:
        self._handle.cancel()


def upstream_key(config: GlobalConfig, region: str) -> str | None:
    """The key for `region`'s workers: the value of its `upstream_api_key_env`, if set."""
    region_config = config.regions.get(region)
    name = region_config.upstream_api_key_env if region_config is not None else None
    return os.environ.get(name) or None if name else None


def set_upstream_key(headers: CIMultiDict[str], key: str | None) -> None:
    """`Authorization: Bearer <key>` for one attempt (the client's own never goes upstream)."""
    if key is None:
        headers.popall("Authorization", None)
    else:
        headers["Authorization"] = f"Bearer {key}"


def upstream_headers(request: web.Request) -> CIMultiDict[str]:
    headers: CIMultiDict[str] = CIMultiDict()
    incoming = request.headers
    for name in FORWARDED_REQUEST_HEADERS:
        value = incoming.get(name)
        if value is not None:
            headers[name] = value
    return headers


def _answer_headers(
    base: Mapping[str, str], response: aiohttp.ClientResponse, attempt: Attempt
) -> dict[str, str]:
    """Headers for the client: ours, the upstream's content type, upstream TTFB in timing."""
    headers = {**base, "Content-Type": _content_type(response)}
    ttfb_s = attempt.ttfb_s
    if ttfb_s is not None:
        timing = base.get("server-timing")
        upstream = f"upstream;dur={ttfb_s * 1000:.3f}"
        headers["server-timing"] = f"{timing}, {upstream}" if timing else upstream
    return headers


def _content_type(response: aiohttp.ClientResponse) -> str:
    return response.headers.get("Content-Type", "application/json")


def _retry_after(headers: Mapping[str, str]) -> float | None:
    value = headers.get("Retry-After")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


async def _send(
    session: aiohttp.ClientSession, url: str, body: bytes, headers: CIMultiDict[str]
) -> aiohttp.ClientResponse:
    try:
        for _ in range(STALE_CONNECTION_RETRIES):
            try:
                return await session.post(url, data=body, headers=headers)
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                if isinstance(exc, aiohttp.ClientConnectorError):
                    raise
                # Most likely a pooled connection the worker closed while it sat idle
                # (nothing of the request was processed): the pool drops it, try again.
        return await session.post(url, data=body, headers=headers)
    except aiohttp.ClientConnectorError as exc:
        raise UpstreamFailure(f"cannot connect to worker: {exc.os_error or exc}",
                              Failure.CONNECT) from None
    except aiohttp.ConnectionTimeoutError:
        # The connect itself timed out (`connect_s`): a path failure, like a refusal.
        raise UpstreamFailure("cannot connect to worker: connect timed out",
                              Failure.CONNECT) from None
    except aiohttp.ClientError as exc:
        raise UpstreamFailure(f"worker connection failed: {exc!r}", Failure.RESET) from None


def _retryable(status: int) -> Failure | None:
    """What a worker's refusal with `status` counts as, if it is worth a retry elsewhere:
    429/503 "engine busy" (BUSY, not a failure of the worker), other 5xx SERVER_ERROR."""
    if status in (429, 503):
        return Failure.BUSY
    return Failure.SERVER_ERROR if status >= 500 else None


async def _refuse_if_failed(response: aiohttp.ClientResponse) -> bytes | None:
    """Read a non-200 answer: raise UpstreamFailure if it is worth a retry, else return it."""
    if response.status == 200:
        return None
    body = await response.read()
    response.release()
    kind = _retryable(response.status)
    if kind is not None:
        raise UpstreamFailure(
            f"worker answered {response.status}: {body[:200].decode(errors='replace')}",
            kind,
            status=response.status,
            retry_after_s=_retry_after(response.headers),
        )
    return body


async def forward_unary(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    headers: CIMultiDict[str],
    timeouts: Timeouts,
    response_headers: Mapping[str, str],
    attempt: Attempt,
) -> web.Response:
    """A non-streaming request: the whole answer, or UpstreamFailure."""
    try:
        async with asyncio.timeout(timeouts.total_s):
            response = await _send(session, url, body, headers)
            answer = await _refuse_if_failed(response)
            if answer is None:
                try:
                    answer = await response.read()
                finally:
                    response.release()
    except TimeoutError:
        raise UpstreamFailure(f"no answer within {timeouts.total_s:g} s", Failure.TIMEOUT,
                              status=504) from None
    except aiohttp.ClientError as exc:
        raise UpstreamFailure(f"worker connection failed: {exc!r}", Failure.RESET) from None
    attempt.first_byte_s = time.monotonic()
    attempt.status = response.status
    return web.Response(
        status=response.status, body=answer,
        headers=_answer_headers(response_headers, response, attempt),
    )


async def forward_stream(
    request: web.Request,
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    headers: CIMultiDict[str],
    timeouts: Timeouts,
    response_headers: Mapping[str, str],
    attempt: Attempt,
) -> web.StreamResponse:
    """A streaming request, passed through chunk by chunk without parsing the events."""
    upstream: aiohttp.ClientResponse | None = None
    try:
        async with asyncio.timeout(timeouts.first_byte_s) as deadline:
            attempt.first_byte_deadline = deadline  # health may abandon a stalled attempt
            try:
                upstream = await _send(session, url, body, headers)
                refused = await _refuse_if_failed(upstream)
                if refused is not None:
                    attempt.first_byte_s = time.monotonic()
                    attempt.status = upstream.status
                    return web.Response(
                        status=upstream.status, body=refused,
                        headers=_answer_headers(response_headers, upstream, attempt),
                    )
                first = await upstream.content.readany()
            finally:
                attempt.first_byte_deadline = None
    except TimeoutError:
        if upstream is not None:
            upstream.close()  # the engine stops working on it; the connection is not reused
        if attempt.abandoned is not None:
            raise UpstreamFailure(f"abandoned before its first byte: {attempt.abandoned}",
                                  Failure.TIMEOUT, status=504) from None
        raise UpstreamFailure(
            f"no first byte within {timeouts.first_byte_s:g} s", Failure.TIMEOUT, status=504
        ) from None
    except aiohttp.ClientError as exc:
        raise UpstreamFailure(f"worker connection failed: {exc!r}", Failure.RESET) from None
    if not first:
        upstream.release()
        raise UpstreamFailure("worker closed the stream before its first byte", Failure.RESET)
    refusal = _error_event(first)
    kind = _retryable(refusal[0]) if refusal is not None else None
    if refusal is not None and kind is not None:
        # Nothing has reached the client yet, so this is still a refusal to retry: vLLM
        # answers `200` and then an error event when the engine refuses a request that
        # passed the API server's own admission check (a full queue: 503).
        upstream.close()
        status, message = refusal
        raise UpstreamFailure(
            f"worker answered 200, then an error event {status}: {message}", kind,
            status=status)
    attempt.first_byte_s = time.monotonic()
    attempt.status = 200

    client = web.StreamResponse(
        status=200,
        headers={**_answer_headers(response_headers, upstream, attempt),
                 "Cache-Control": "no-cache"},
    )
    watchdog = _IdleWatchdog(upstream, timeouts.idle_s, timeouts.total_s)
    loop_time = asyncio.get_running_loop().time
    read = upstream.content.readany
    try:
        await client.prepare(request)
        await client.write(first)
        while True:
            try:
                chunk = await read()
            except (aiohttp.ClientError, asyncio.IncompleteReadError) as exc:
                attempt.failure = Failure.IDLE if watchdog.fired else Failure.MID_STREAM
                await client.write(sse_error_event(502, _ended_early(watchdog, exc)))
                break
            if not chunk:
                if watchdog.fired is not None:
                    attempt.failure = Failure.IDLE
                    await client.write(sse_error_event(504, watchdog.fired))
                elif not upstream.content.is_eof():
                    attempt.failure = Failure.MID_STREAM
                    await client.write(sse_error_event(502, "the worker's stream ended early"))
                break
            watchdog.last_s = loop_time()
            await client.write(chunk)
        await client.write_eof()
    except (ConnectionError, asyncio.CancelledError):
        # The client went away: drop the upstream connection so the engine stops generating.
        attempt.client_gone = True
        upstream.close()
        raise
    finally:
        watchdog.cancel()
        upstream.release()
    return client


def _error_event(first: bytes) -> tuple[int, str] | None:
    """(status, message) when a stream's first bytes are an error event, as vLLM writes
    one (`data: {"error": {"message": ..., "code": 503, ...}}`); None for anything else.
    Costs a prefix test per stream: only an event that starts like an error is decoded."""
    if not first.startswith(_ERROR_EVENT_PREFIXES):
        return None
    line = first[5:].split(b"\n", 1)[0]
    try:
        document = json.loads(line)
    except ValueError:
        return None  # not one whole JSON event: passed through as it is
    error = document.get("error") if isinstance(document, dict) else None
    if not isinstance(error, dict):
        return None
    code = error.get("code")
    status = code if isinstance(code, int) and 400 <= code <= 599 else 500
    return status, str(error.get("message", ""))[:200]


_ERROR_EVENT_PREFIXES = (b'data: {"error"', b'data:{"error"')


def _ended_early(watchdog: _IdleWatchdog, exc: BaseException) -> str:
    if watchdog.fired is not None:
        return watchdog.fired
    return f"the worker's stream broke off: {type(exc).__name__}"
