"""One upstream attempt: send the client's bytes to a worker, pass the answer back.

Timeouts are split by phase (see `router.config.Timeouts`):
- connect: TCP connect to the worker (and TLS, for https endpoints);
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
import functools
import json
import os
import ssl
import time
from collections.abc import Callable, Coroutine, Mapping
from http import HTTPStatus
from typing import Any
from urllib.parse import urlsplit

from router.config import GlobalConfig, Timeouts
from router.core.errors import error_body, sse_error_event
from router.core.outcome import Attempt, Failure
from router.proxy.exchange import Exchange, Reply
from router.proxy.progress import error_status
from router.proxy.tls import client_context
from router.proxy.transcript import ErrorEvent, TooManyEvents, Transcript
from router.proxy.upstream.connection import UpstreamConnection
from router.proxy.upstream.errors import ConnectFailed, ConnectionBroken, UpstreamError
from router.proxy.upstream.pool import UpstreamPool
from router.proxy.upstream.request import RequestHead

# Request headers passed to workers. Everything else (Authorization, cookies, hop-by-hop
# headers, Host, Content-Length) stays at the router.
FORWARDED_REQUEST_HEADERS = ("content-type", "accept", "traceparent", "tracestate", "x-request-id")
_FORWARDED = frozenset(FORWARDED_REQUEST_HEADERS)


# Sends repeated at once when the connection breaks before any answer (usually a pooled
# connection the worker closed while it sat idle: nothing of the request was processed).
STALE_CONNECTION_RETRIES = 2


class UpstreamFailure(Exception):
    """An attempt failed before anything reached the client; safe to retry elsewhere.

    `message` may be shown to the client: it names no address and quotes nothing the
    worker sent. `detail` (for logs and traces) adds what the worker or the socket said.
    """

    def __init__(
        self,
        message: str,
        kind: Failure,
        *,
        status: int = 502,
        retry_after_s: float | None = None,
        detail: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.kind = kind
        self.status = status
        self.retry_after_s = retry_after_s
        self.detail = detail if detail is not None else message


class _IdleWatchdog:
    """Watches a started stream: a worker that goes silent, a client that stops reading.

    The upstream connection counts its reads; a timer that wakes every quarter of its
    shortest bound notes when the count last moved. Silence counts against the worker
    only while the router is reading from it (`UpstreamConnection.reading`): while a
    slow client holds the stream back, the router has paused the worker, and its silence
    is ours. So a stall is caught between `idle_s` and 1.25 x `idle_s` of the router
    asking for data in vain. While the router is held back, the client is watched
    instead: when it has taken nothing for `client_stall_s` (its write buffer neither
    shrank nor let the worker's data flow), it is cut off (`on_client_stall`). A stream
    past `total_s` ends as the worker's fault if the router was reading, the client's if
    it was held back. Nothing is re-armed, and no clock read, per chunk.
    """

    __slots__ = ("_client_pending", "_client_stall_s", "_deadline", "_exchange", "_handle",
                 "_held_since", "_idle_s", "_interval_s", "_loop", "_on_client_stall",
                 "_quiet_since", "_reads", "_upstream", "client_fired", "fired")

    def __init__(self, loop: asyncio.AbstractEventLoop, upstream: UpstreamConnection,
                 exchange: Exchange, timeouts: Timeouts, client_stall_s: float,
                 on_client_stall: Callable[[], None]) -> None:
        self._loop = loop
        self._upstream = upstream
        self._exchange = exchange
        self._idle_s = idle_s = timeouts.idle_s
        self._client_stall_s = client_stall_s
        self._on_client_stall = on_client_stall
        now = loop.time()
        self._deadline = now + timeouts.total_s
        self._reads = upstream.reads
        self._quiet_since = now  # the stream's first bytes were just read
        self._held_since: float | None = None  # the client holds the stream back since
        self._client_pending = 0
        self.fired: str | None = None  # the worker's fault
        self.client_fired: str | None = None  # the client's
        self._interval_s = min(idle_s, client_stall_s, timeouts.total_s) / 4
        self._handle = self._loop.call_later(self._interval_s, self._check)

    def _check(self) -> None:
        now = self._loop.time()
        upstream = self._upstream
        reads = upstream.reads
        moved = reads != self._reads
        self._reads = reads
        if upstream.reading:
            self._held_since = None
            if moved:
                self._quiet_since = now
            elif now - self._quiet_since >= self._idle_s:
                self.fired = f"no data from the worker for {self._idle_s:g} s"
            if self.fired is None and now >= self._deadline:
                self.fired = "the request ran past its total timeout"
        else:
            self._quiet_since = now  # not asking the worker for anything: not its silence
            self._client_held(now, moved)
        if self.fired is not None:
            upstream.close()
            return
        if self.client_fired is not None:
            self._on_client_stall()
            return
        self._handle = self._loop.call_later(self._interval_s, self._check)

    def _client_held(self, now: float, moved: bool) -> None:
        pending = self._exchange.client_pending_bytes()
        if self._held_since is None or moved or pending < self._client_pending:
            self._held_since = now  # (still) taking what it is sent
        elif now - self._held_since >= self._client_stall_s:
            self.client_fired = f"the client read nothing for {self._client_stall_s:g} s"
        if self.client_fired is None and now >= self._deadline:
            self.client_fired = "the client read too slowly to finish within the total timeout"
        self._client_pending = pending

    def cancel(self) -> None:
        self._handle.cancel()


class Deadline:
    """The time limit on one attempt's wait for its answer, as cheap as a timer.

    When it expires it closes the attempt's upstream connection, which fails the pending
    read, or cancels the waiting task while it is still connecting (`asyncio.timeout`
    does the same with more bookkeeping: it cost ~10 us per request here).
    `reschedule(now)` is how health abandons a stalled attempt (`Attempt.abandon`).
    """

    __slots__ = ("_cancelled", "_handle", "_loop", "_task", "expired", "upstream")

    def __init__(self, delay_s: float, loop: asyncio.AbstractEventLoop) -> None:
        """`loop` is the running loop (the caller's, at hand: looking it up costs a
        system call)."""
        self._loop = loop
        self._task = asyncio.current_task(loop)
        self.upstream: UpstreamConnection | None = None
        self.expired = False
        self._cancelled = False  # it cancelled the task
        self._handle = self._loop.call_later(delay_s, self._expire)

    def reschedule(self, when: float | None) -> None:
        """Expire at loop time `when` instead (None: never)."""
        self._handle.cancel()
        if when is not None and not self.expired:
            self._handle = self._loop.call_at(when, self._expire)

    def cancel(self) -> None:
        self._handle.cancel()

    def _expire(self) -> None:
        self.expired = True
        if self.upstream is not None:
            self.upstream.close()
        elif self._task is not None:
            self._task.cancel()
            self._cancelled = True

    def timed_out(self) -> bool:
        """After a CancelledError: True if this deadline caused it (and it is taken
        back), False if something else cancelled the task."""
        return self._cancelled and self._task is not None and self._task.uncancel() == 0


def upstream_key(config: GlobalConfig, region: str) -> str | None:
    """The key for `region`'s workers: the value of its `upstream_api_key_env`, if set."""
    region_config = config.regions.get(region)
    name = region_config.upstream_api_key_env if region_config is not None else None
    return os.environ.get(name) or None if name else None


def upstream_headers(incoming: Mapping[str, str]) -> dict[str, str]:
    """The client's headers that workers see (lower-case names)."""
    if type(incoming) is dict:  # the front's: lower-case names already
        return {name: value for name, value in incoming.items() if name in _FORWARDED}
    headers: dict[str, str] = {}
    for name in FORWARDED_REQUEST_HEADERS:
        value = incoming.get(name)
        if value is not None:
            headers[name] = value
    return headers


class Target:
    """Where one worker's requests go: address, path prefix and the request's head."""

    __slots__ = ("_heads", "base_path", "host", "host_header", "port", "ssl")

    def __init__(self, endpoint: str) -> None:
        parts = urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) endpoint: {endpoint!r}")
        secure = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if secure else 80)
        self.host_header = parts.netloc.rpartition("@")[2]
        self.base_path = parts.path.rstrip("/")
        self.ssl: ssl.SSLContext | None = client_context() if secure else None  # one for all
        self._heads: dict[str, RequestHead] = {}  # per path: the request line and Host

    def request(self, path: str, headers: Mapping[str, str], body: bytes) -> bytes:
        """`encode_request("POST", base_path + path, host_header, headers.items(), body)`;
        `headers` have lower-case names (`upstream_headers`)."""
        head = self._heads.get(path)
        if head is None:
            head = self._heads[path] = RequestHead("POST", self.base_path + path,
                                                   self.host_header)
        return head.encode_lower(headers, body)


@functools.lru_cache(maxsize=16384)
def target_of(endpoint: str) -> Target:
    """One `Target` per worker endpoint (parsed once, not per request). Endpoints that left
    the fleet (a restarted pod's old address) age out: ~1.3 KB each, 22 MB at most, and
    room for a 10,000-worker fleet's own."""
    return Target(endpoint)


def _answer_headers(
    headers: dict[str, str], upstream: UpstreamConnection, attempt: Attempt
) -> dict[str, str]:
    """`headers` (ours) completed in place for the client: the upstream's content type,
    and the upstream's TTFB added to `server-timing`."""
    headers["Content-Type"] = upstream.headers.get("content-type", "application/json")
    ttfb_s = attempt.ttfb_s
    if ttfb_s is not None:
        timing = headers.get("server-timing")
        upstream_timing = f"upstream;dur={ttfb_s * 1000:.3f}"
        headers["server-timing"] = f"{timing}, {upstream_timing}" if timing else upstream_timing
    return headers


def _retry_after(headers: Mapping[str, str]) -> float | None:
    value = headers.get("retry-after")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


async def _send(pool: UpstreamPool, target: Target, payload: bytes,
                deadline: Deadline) -> UpstreamConnection:
    """Send the request and wait for the answer's head (status and headers)."""
    for tries_left in range(STALE_CONNECTION_RETRIES, -1, -1):
        try:
            upstream = (pool.send_idle(target.host, target.port, payload)
                        or await pool.send(target.host, target.port, payload, ssl=target.ssl))
        except ConnectFailed as exc:
            raise UpstreamFailure("could not connect to the worker", Failure.CONNECT,
                                  detail=f"cannot connect to worker: {exc}") from None
        deadline.upstream = upstream
        try:
            await upstream.head()
        except ConnectionBroken as broken:  # (not `exc`: the compiled build types a name once)
            upstream.close()
            if not broken.received_any and tries_left and not deadline.expired:
                # Broken before any answer: most likely a pooled connection the worker
                # had closed (stale), else a worker that just died or restarted. Sent
                # again on a new connection: a dead worker then refuses it, which is a
                # path failure (a free retry elsewhere), not a reset.
                deadline.upstream = None
                continue
            raise
        except BaseException:
            upstream.close()  # cancelled: the engine stops working on it
            raise
        return upstream
    raise AssertionError("unreachable")


def _retryable(status: int) -> Failure | None:
    """What a worker's refusal with `status` counts as, if it is worth a retry elsewhere:
    429/503 "engine busy" (BUSY, not a failure of the worker), other 5xx SERVER_ERROR."""
    if status in (429, 503):
        return Failure.BUSY
    return Failure.SERVER_ERROR if status >= 500 else None


async def _refuse_if_failed(upstream: UpstreamConnection) -> bytes | None:
    """Read a non-200 answer: raise UpstreamFailure if it is worth a retry, else return it
    as the client gets it (an error in OpenAI's format: `client_error_body`)."""
    if upstream.status == 200:
        return None
    body = await _read_all(upstream)
    status = upstream.status
    kind = _retryable(status)
    if kind is not None:
        raise UpstreamFailure(
            f"the worker answered {status}", kind, status=status,
            retry_after_s=_retry_after(upstream.headers),
            detail=f"worker answered {status}: {body[:200].decode(errors='replace')}",
        )
    if status >= 400:
        upstream.headers["content-type"] = "application/json"
        return client_error_body(status, body)
    return body


async def _read_all(upstream: UpstreamConnection) -> bytes:
    try:
        body = await upstream.read_all()
    except BaseException:
        upstream.close()
        raise
    upstream.release()
    return body


async def forward_unary(
    pool: UpstreamPool,
    target: Target,
    payload: bytes,
    timeouts: Timeouts,
    response_headers: dict[str, str],
    attempt: Attempt,
) -> Reply:
    """A non-streaming request: the whole answer (with `response_headers`, completed),
    or UpstreamFailure."""
    # The whole wait is the first-byte phase of a non-streaming answer (it comes when
    # generation is done), so passive health may abandon it too (Attempt.abandon): a hung
    # worker is found by its heartbeats, not by total_s.
    deadline = attempt.first_byte_deadline = Deadline(timeouts.total_s, pool.loop)
    try:
        upstream = await _send(pool, target, payload, deadline)
        answer = upstream.whole_body() if upstream.status == 200 else None
        if answer is not None:
            upstream.release()
        else:
            attempt.answering = upstream
            attempt.answer_head = (upstream.reads, time.monotonic())
            answer = await _refuse_if_failed(upstream)
            if answer is None:
                answer = await _read_all(upstream)
    except ConnectionBroken as exc:
        if deadline.expired:
            raise _unary_timeout(attempt, timeouts) from None
        raise _broken_before_answer(exc) from None
    except asyncio.CancelledError:
        if deadline.timed_out():
            raise _unary_timeout(attempt, timeouts) from None
        raise
    finally:
        deadline.cancel()
        attempt.first_byte_deadline = None
        attempt.answering = None
    attempt.first_byte_s = time.monotonic()
    attempt.status = upstream.status
    return Reply(upstream.status, _answer_headers(response_headers, upstream, attempt), answer)


class StreamBroken(UpstreamFailure):
    """A started stream broke off (its client has had some of it): the caller may
    continue it on another worker (`router.proxy.continuation`) or end it with
    `end_broken_stream`. `status` and `message` are the error event's."""


async def open_stream(pool: UpstreamPool, target: Target, payload: bytes,
                      timeouts: Timeouts, attempt: Attempt
                      ) -> tuple[UpstreamConnection, bytes, bool]:
    """Send a streaming request and wait for the answer's first event: (the connection,
    its first bytes, refused). `refused`: the worker answered other than 200 and `first`
    is that whole answer (the connection released), as the client may get it. Raises
    UpstreamFailure for a failure worth a retry elsewhere: no first byte in time, a
    connection that broke, a first event that is an error worth a retry."""
    deadline = attempt.first_byte_deadline = Deadline(timeouts.first_byte_s, pool.loop)
    try:
        upstream = await _send(pool, target, payload, deadline)
        refused = await _refuse_if_failed(upstream)
        if refused is not None:
            return upstream, refused, True
        try:
            first = await upstream.read_some()
            if (first and b"\n\n" not in first and b"\r\n\r\n" not in first
                    and upstream.headers.get("content-type", "").startswith(_SSE)):
                first = await _first_event(upstream, first)
        except BaseException:
            upstream.close()
            raise
    except ConnectionBroken as exc:
        if deadline.expired:
            raise _first_byte_timeout(attempt, timeouts) from None
        raise _broken_before_answer(exc) from None
    except asyncio.CancelledError:
        if deadline.timed_out():
            raise _first_byte_timeout(attempt, timeouts) from None
        raise
    finally:
        deadline.cancel()
        attempt.first_byte_deadline = None
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
            f"the worker answered 200, then an error event {status}", kind, status=status,
            detail=f"worker answered 200, then an error event {status}: {message}")
    return upstream, first, False


async def forward_stream(
    exchange: Exchange,
    pool: UpstreamPool,
    target: Target,
    payload: bytes,
    timeouts: Timeouts,
    response_headers: dict[str, str],
    attempt: Attempt,
    client_stall_s: float = 60.0,
    transcript: Transcript | None = None,
) -> Reply:
    """A streaming request, passed through as it arrives without parsing the events
    (`response_headers` are completed for the client). With a `transcript`, what the
    client got is kept and a stream that breaks off raises StreamBroken (the stream left
    open) instead of ending with an error event."""
    upstream, first, refused = await open_stream(pool, target, payload, timeouts, attempt)
    attempt.first_byte_s = time.monotonic()
    if refused:
        attempt.status = upstream.status
        return Reply(upstream.status, _answer_headers(response_headers, upstream, attempt),
                     first)
    attempt.status = 200
    headers = _answer_headers(response_headers, upstream, attempt)
    headers["Cache-Control"] = "no-cache"
    await _pass_on(exchange, pool.loop, upstream, timeouts, attempt, client_stall_s, transcript,
                   exchange.relay(headers, first, upstream, transcript))
    return Reply(200, headers, streamed=True)


async def continue_stream(
    exchange: Exchange,
    pool: UpstreamPool,
    target: Target,
    payload: bytes,
    timeouts: Timeouts,
    attempt: Attempt,
    client_stall_s: float,
    transcript: Transcript,
    rewrite: Callable[[bytes], bytes],
    server_timing: Callable[[], str] | None = None,
) -> None:
    """Continue a broken stream on another worker: `payload` asks it for the rest of the
    answer, and `rewrite` turns its events into the client's (see
    `router.proxy.continuation`). Raises UpstreamFailure when the worker does not start
    (the stream is left as it was), StreamBroken when it breaks off too. A stream that
    ends well ends with the `server_timing()` trailer."""
    upstream, first, refused = await open_stream(pool, target, payload, timeouts, attempt)
    attempt.status = upstream.status
    if refused:
        raise UpstreamFailure(
            f"the worker refused the continuation ({upstream.status})",
            Failure.REFUSED if upstream.status < 500 else Failure.SERVER_ERROR,
            status=upstream.status,
            detail=f"worker refused the continuation ({upstream.status}): "
                   f"{first[:200].decode(errors='replace')}")
    refusal = _error_event(first)
    if refusal is not None:
        upstream.close()
        raise UpstreamFailure(
            f"the worker refused the continuation ({refusal[0]})", Failure.REFUSED,
            status=refusal[0], detail=f"worker refused the continuation: {refusal[1]}")
    attempt.first_byte_s = time.monotonic()
    await _pass_on(exchange, pool.loop, upstream, timeouts, attempt, client_stall_s, transcript,
                   exchange.relay_more(first, upstream, rewrite), server_timing)


async def _pass_on(
    exchange: Exchange, loop: asyncio.AbstractEventLoop, upstream: UpstreamConnection,
    timeouts: Timeouts, attempt: Attempt,
    client_stall_s: float, transcript: Transcript | None,
    relaying: Coroutine[Any, Any, UpstreamError | None],
    server_timing: Callable[[], str] | None = None,
) -> None:
    """Run `relaying` (the stream passing to the client) under the idle watchdog, and end
    the stream: as it came, with an error event, or (a `transcript` kept) open for a
    continuation (StreamBroken)."""
    def client_stalled() -> None:
        attempt.client_stalled = True
        exchange.abort_client()  # cancels the request: the upstream is closed below

    watchdog = _IdleWatchdog(loop, upstream, exchange, timeouts, client_stall_s,
                             client_stalled)
    try:
        broken = await relaying
        if attempt.client_stalled:
            raise ConnectionResetError(watchdog.client_fired)
        if broken is None:
            await exchange.end_stream(b"", None if server_timing is None else server_timing())
            return
        attempt.failure = Failure.IDLE if watchdog.fired else Failure.MID_STREAM
        status, message = _ended_early(watchdog, broken)
        attempt.error = f"{message}: {broken}"
        if transcript is not None:
            raise StreamBroken(message, attempt.failure, status=status, detail=attempt.error)
        await exchange.end_stream(sse_error_event(status, message, code="upstream_failed"))
    except (ConnectionError, asyncio.CancelledError):
        # The client went away: drop the upstream connection so the engine stops generating.
        attempt.client_gone = True
        upstream.close()
        raise
    finally:
        watchdog.cancel()
        upstream.release()  # closes it unless the answer was read to its end


async def end_broken_stream(exchange: Exchange, transcript: Transcript | None,
                            broken: StreamBroken) -> None:
    """End a stream that broke off and is not continued: the events owed to its client,
    then an error event."""
    owed = b"" if transcript is None else transcript.take_owed()
    await exchange.end_stream(owed + sse_error_event(broken.status, broken.message,
                                                     code="upstream_failed"))


# A stream's first event is awaited whole up to this size before anything is sent on.
MAX_FIRST_EVENT_BYTES = 1024 * 1024
_SSE = "text/event-stream"


async def _first_event(upstream: UpstreamConnection, first: bytes) -> bytes:
    """`first` and what follows, until it holds one whole event (a blank line ends an SSE
    event): nothing reaches the client before, so a worker that breaks off inside its
    first event is still retried elsewhere (ConnectionBroken), not a client's lost
    stream. A body that ends inside its first event is broken too."""
    pieces = [first]
    size = len(first)
    while size < MAX_FIRST_EVENT_BYTES:
        more = await upstream.read_some()
        if not more:
            raise ConnectionBroken("the stream ended inside its first event", stale=False,
                                   received_any=True)
        pieces.append(more)
        size += len(more)
        joined = b"".join(pieces)
        if b"\n\n" in joined or b"\r\n\r\n" in joined:
            return joined
    return b"".join(pieces)


def _first_byte_timeout(attempt: Attempt, timeouts: Timeouts) -> UpstreamFailure:
    return _timed_out(attempt, f"no first byte within {timeouts.first_byte_s:g} s")


def _unary_timeout(attempt: Attempt, timeouts: Timeouts) -> UpstreamFailure:
    return _timed_out(attempt, f"no answer within {timeouts.total_s:g} s")


def _timed_out(attempt: Attempt, message: str) -> UpstreamFailure:
    """The attempt's wait ended: abandoned by passive health (a stalled worker), or
    `message` (its own deadline)."""
    if attempt.abandoned is not None:
        return UpstreamFailure("the worker stopped answering", Failure.TIMEOUT, status=504,
                               detail=f"abandoned before its first byte: {attempt.abandoned}")
    return UpstreamFailure(message, Failure.TIMEOUT, status=504)


def _broken_before_answer(exc: ConnectionBroken) -> UpstreamFailure:
    return UpstreamFailure("the connection to the worker broke before its answer",
                           Failure.RESET, detail=f"worker connection failed: {exc}")


def client_error_body(status: int, body: bytes) -> bytes:
    """A worker's 4xx (or other non-retried) error as the client gets it: OpenAI-format
    JSON. vLLM's own errors (`{"error": {...}}`) pass as they are; an older vLLM's flat
    `{"object": "error", "message": ...}` keeps its message and code; anything else (a
    `text/plain` "404: Not Found", HTML from a proxy in front of the worker) is replaced
    by a message that quotes none of it."""
    try:
        document = json.loads(body)
    except ValueError:
        document = None
    if isinstance(document, dict):
        error = document.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return body
        message = document.get("message")
        if isinstance(message, str):
            code = document.get("code")
            return error_body(status, message[:1000],
                              code=code if isinstance(code, str) else "upstream_error")
    phrase = _PHRASES.get(status, "error")
    return error_body(status, f"the worker answered {status} {phrase}", code="upstream_error")


_PHRASES = {status.value: status.phrase for status in HTTPStatus}


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
    return error_status(error)


_ERROR_EVENT_PREFIXES = (b'data: {"error"', b'data:{"error"')


def _ended_early(watchdog: _IdleWatchdog, broken: UpstreamError) -> tuple[int, str]:
    """The status and message of the error event that ends a stream broken off early
    (safe to show: the socket's own words, with the worker's address, go to the log)."""
    if watchdog.fired is not None:
        return 504, watchdog.fired
    if isinstance(broken, TooManyEvents):
        return 502, "the worker streamed past the request's max_tokens"
    if isinstance(broken, ErrorEvent):
        return broken.status, "the worker failed mid-stream"
    return 502, "the worker's stream broke off"
