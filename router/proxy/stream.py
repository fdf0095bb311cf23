"""A streaming request upstream: its first event awaited, then relayed as it arrives.

Nothing reaches the client before the stream's first whole event, so a failure up to then
(no first byte in time, a broken connection, a first event that is an error worth a
retry) raises `UpstreamFailure` and the caller may retry elsewhere. After it, the stream
belongs to the client: a failure ends it with an SSE error event, or (a transcript kept)
raises `StreamBroken` so that the caller may continue it on another worker
(`continue_stream`, `router.proxy.continuation`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any

from router.config import Timeouts
from router.core.errors import sse_error_event
from router.core.outcome import Attempt, Failure
from router.proxy.continuation import Rewriter
from router.proxy.exchange import Exchange, Reply
from router.proxy.failures import (
    StreamBroken,
    UpstreamFailure,
    broken_before_answer,
    error_event,
    first_byte_timeout,
    retryable,
)
from router.proxy.send import answer_headers, refuse_if_failed, send
from router.proxy.targets import Target
from router.proxy.timeouts import Deadline, IdleWatchdog
from router.proxy.transcript import ErrorEvent, TooManyEvents, Transcript
from router.proxy.upstream.connection import UpstreamConnection
from router.proxy.upstream.errors import ConnectionBroken, UpstreamError
from router.proxy.upstream.pool import UpstreamPool

# A stream's first event is awaited whole up to this size before anything is sent on.
MAX_FIRST_EVENT_BYTES = 1024 * 1024
_SSE = "text/event-stream"


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
        upstream = await send(pool, target, payload, deadline, attempt)
        refused = await refuse_if_failed(upstream)
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
            raise first_byte_timeout(attempt, timeouts) from None
        raise broken_before_answer(exc) from None
    except asyncio.CancelledError:
        if deadline.timed_out():
            raise first_byte_timeout(attempt, timeouts) from None
        raise
    finally:
        deadline.cancel()
        attempt.first_byte_deadline = None
    if not first:
        upstream.release()
        raise UpstreamFailure("worker closed the stream before its first byte", Failure.RESET)
    refusal = error_event(first)
    kind = retryable(refusal[0]) if refusal is not None else None
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
    on_first: Callable[[bytes, Attempt], None] | None = None,
    opened: tuple[UpstreamConnection, bytes, bool] | None = None,
) -> Reply:
    """A streaming request, passed through as it arrives without parsing the events
    (`response_headers` are completed for the client). With a `transcript`, what the
    client got is kept and a stream that breaks off raises StreamBroken (the stream left
    open) instead of ending with an error event. `on_first` gets the stream's first event
    before it is passed on. `opened`: what `open_stream` gave, when it was sent already
    (a hedged stream's: `payload` is then unused)."""
    upstream, first, refused = (
        opened or await open_stream(pool, target, payload, timeouts, attempt))
    attempt.first_byte(time.monotonic())
    if refused:
        attempt.status = upstream.status
        return Reply(upstream.status, answer_headers(response_headers, upstream, attempt),
                     first)
    attempt.status = 200
    if on_first is not None:
        on_first(first, attempt)
    headers = answer_headers(response_headers, upstream, attempt)
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
    rewrite: Rewriter,
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
    refusal = error_event(first)
    if refusal is not None:
        upstream.close()
        raise UpstreamFailure(
            f"the worker refused the continuation ({refusal[0]})", Failure.REFUSED,
            status=refusal[0], detail=f"worker refused the continuation: {refusal[1]}")
    attempt.first_byte(time.monotonic())
    await _pass_on(exchange, pool.loop, upstream, timeouts, attempt, client_stall_s, transcript,
                   _to_its_end(exchange.relay_more(first, upstream, rewrite), rewrite),
                   server_timing)


async def _to_its_end(relaying: Coroutine[Any, Any, UpstreamError | None],
                      rewrite: Rewriter) -> UpstreamError | None:
    """`relaying` a continuation, and a body that ended inside an event as broken."""
    broken = await relaying
    return rewrite.ended() if broken is None else broken


async def _pass_on(
    exchange: Exchange, loop: asyncio.AbstractEventLoop, upstream: UpstreamConnection,
    timeouts: Timeouts, attempt: Attempt,
    client_stall_s: float, transcript: Transcript | None,
    relaying: Coroutine[Any, Any, UpstreamError | None],
    server_timing: Callable[[], str] | None = None,
) -> None:
    """Run `relaying` (the stream passing to the client) under the idle watchdog, and end
    the stream: as it came, with an error event, or (a `transcript` kept) open for a
    continuation (StreamBroken). The attempt's pace is noted as the relay ends: the reads
    it passed on (each a gap between chunks) and when (not timed per chunk: see
    `Attempt.stream_gaps`)."""
    def client_stalled() -> None:
        attempt.client_stalled = True
        exchange.abort_client()  # cancels the request: the upstream is closed below

    watchdog = IdleWatchdog(loop, upstream, exchange, timeouts, client_stall_s,
                            client_stalled)
    reads_before = upstream.reads  # (the relay starts when awaited)
    attempt.answering = upstream  # health may cut it (its engine stuck: Health.check_stalls)
    try:
        broken = await relaying
        attempt.stream_ended_s = time.monotonic()
        attempt.stream_gaps = upstream.reads - reads_before
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
        attempt.answering = None
        watchdog.cancel()
        upstream.release()  # closes it unless the answer was read to its end


async def end_broken_stream(exchange: Exchange, transcript: Transcript | None,
                            broken: StreamBroken) -> None:
    """End a stream that broke off and is not continued: the events owed to its client,
    then an error event."""
    owed = b"" if transcript is None else transcript.take_owed()
    await exchange.end_stream(owed + sse_error_event(broken.status, broken.message,
                                                     code="upstream_failed"))


def _ended_early(watchdog: IdleWatchdog, broken: UpstreamError) -> tuple[int, str]:
    """The status and message of the error event that ends a stream broken off early
    (safe to show: the socket's own words, with the worker's address, go to the log)."""
    if watchdog.fired is not None:
        return 504, watchdog.fired
    if isinstance(broken, TooManyEvents):
        return 502, "the worker streamed past the request's max_tokens"
    if isinstance(broken, ErrorEvent):
        return broken.status, "the worker failed mid-stream"
    return 502, "the worker's stream broke off"
