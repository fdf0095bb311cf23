"""One keep-alive connection to a worker (an asyncio Protocol), carrying one request at a
time: it hands the answer's head and body to its caller, read (`read_some`, `read_all`)
or piped (`pipe`) to a sink straight from `data_received`.

The connection delivers; what it holds apart: where the parser is (`decoder`), the body
bytes held for a reader with its waiter and the reading switch (`buffer`). Its pool
(`pool.UpstreamPool`) keeps it between requests and is told of it through
`sinks.ConnectionKeeper`.
"""

from __future__ import annotations

import asyncio
import socket
import typing
from typing import cast

from router.proxy.upstream.buffer import ReadBuffer
from router.proxy.upstream.chunks import whole_chunks
from router.proxy.upstream.decoder import (
    CHUNK_SIZE,
    DONE,
    HEAD,
    IDLE,
    LENGTH,
    UNTIL_CLOSE,
    AnswerDecoder,
)
from router.proxy.upstream.errors import ConnectionBroken, MalformedAnswer
from router.proxy.upstream.sinks import ConnectionKeeper, Sink


class UpstreamConnection(asyncio.Protocol):
    """One keep-alive connection to a worker, carrying one request at a time.

    Obtained from `UpstreamPool.send` with the request already written. Read the head
    (`head`), then the body (`read_some`, `read_all` or `pipe`), then `release` it (back to
    the pool) or `close` it (abort). After `release` the object belongs to the pool again:
    do not use it.
    """

    __slots__ = (
        "_buffer", "_closed", "_complete", "_decoder", "_error", "_head_ready", "_keeper",
        "_loop", "_pipe_future", "_received_any", "_released", "_reusable", "_reused",
        "_sink", "_write_frame", "clock", "headers", "idle_since", "key", "parked",
        "reads", "status", "transport",
    )

    status: int
    headers: dict[str, str]
    reads: int  # reads from the socket so far: a stream's idle watchdog compares them
    key: tuple[str, int]  # the worker's (host, port): the pool's key
    transport: asyncio.Transport | None  # the socket's (None until connected)
    clock: typing.Callable[[], float]  # the loop's `time`
    # The pool's bookkeeping: idle in it, and since when (`clock`).
    parked: bool
    idle_since: float

    def __init__(self, keeper: ConnectionKeeper[UpstreamConnection], key: tuple[str, int]) -> None:
        # Kept: `asyncio.get_running_loop()` costs a getpid() system call on every call
        # (CPython 3.11 checks for a fork), twice per request where it was called.
        self._loop = loop = asyncio.get_running_loop()
        self._keeper = keeper
        self.key = key
        self.clock = loop.time
        self.transport = None
        self._closed = False  # the transport is gone (connection_lost) or aborted by us
        self.parked = False
        self.idle_since = 0.0
        self._decoder = AnswerDecoder()
        self._buffer = ReadBuffer()
        self.reads = 0
        self._reset(reused=False)
        self._released = True

    def _reset(self, *, reused: bool) -> None:
        """Forget the previous answer: a new request is about to be written."""
        self.status = 0
        self.headers = {}
        self._head_ready = False
        self._complete = False
        self._error: str | None = None  # why the answer broke
        self._reusable = True  # nothing we saw forbids reuse (cancelled, extra bytes, ...)
        self._reused = reused
        self._received_any = False
        self._released = False
        self._sink: Sink | None = None
        self._write_frame: typing.Callable[[bytes], None] | None = None
        self._pipe_future: asyncio.Future[None] | None = None

    # -- the caller's side --

    @property
    def complete(self) -> bool:
        """The whole answer has arrived (its body may still wait in the buffer)."""
        return self._complete

    @property
    def reading(self) -> bool:
        """The router is asking the worker for data now: a reader waits or a sink is
        piped, and reading is not paused (by a slow sink or a full buffer). Only while
        this holds can silence be the worker's: a stream's idle watchdog counts nothing
        else, so a client that stops reading never makes its worker look idle."""
        buffer = self._buffer
        return not buffer.paused and (self._sink is not None or buffer.waiter is not None)

    async def head(self) -> tuple[int, dict[str, str]]:
        """Wait for the status line and headers (1xx interim answers are skipped).

        Header names are lower-case; a repeated header's values are joined with ", ".
        Raises ConnectionBroken if the connection breaks first or the head is malformed.
        """
        buffer = self._buffer
        while not self._head_ready:
            if self._error is not None:
                raise self._broken()
            waiter = buffer.waiter = self._loop.create_future()  # see `ReadBuffer.wake`
            try:
                await waiter
            except asyncio.CancelledError:
                self._reusable = False  # the answer is left unread
                raise
            finally:
                buffer.waiter = None
        return self.status, self.headers

    async def read_some(self) -> bytes:
        """The decoded body bytes available now, waiting for some if there are none.

        b"" when the body is complete. Bytes that arrived before the connection broke are
        returned first; the next call raises ConnectionBroken.
        """
        if self._sink is not None:
            raise RuntimeError("read_some() on a piped connection")
        buffer = self._buffer
        while True:
            if buffer.pieces:
                return buffer.take()
            if self._complete:
                return b""
            if self._error is not None:
                raise self._broken()
            waiter = buffer.waiter = self._loop.create_future()  # as in `head`, inline:
            try:  # a nested coroutine per wait cost more than these lines
                await waiter
            except asyncio.CancelledError:
                self._reusable = False  # the answer is left half-read
                raise
            finally:
                buffer.waiter = None

    def whole_body(self) -> bytes | None:
        """The rest of the body, without waiting, when the whole answer has arrived (a
        small answer usually comes in the read that brought its head); else None, and
        `read_all` is the way. Saves such an answer the awaits of `read_all`."""
        if not self._complete or self._sink is not None:
            return None
        buffer = self._buffer
        return buffer.take() if buffer.pieces else b""

    async def read_all(self, limit: int = 64 * 1024 * 1024) -> bytes:
        """The whole rest of the body. ConnectionBroken (and the connection closed) when it
        breaks or exceeds `limit` bytes."""
        pieces: list[bytes] = []
        size = 0
        while True:
            data = await self.read_some()
            if not data:
                return pieces[0] if len(pieces) == 1 else b"".join(pieces)
            size += len(data)
            if size > limit:
                self.close()
                raise ConnectionBroken(
                    f"{self.key[0]}:{self.key[1]}: the answer's body is larger than {limit} "
                    "bytes", stale=False, received_any=True)
            pieces.append(data)

    def pipe(self, sink: Sink) -> asyncio.Future[None]:
        """Hand every decoded body byte to `sink.write` from now on, from `data_received`.

        Bytes already buffered are written first, here. Each read from the socket makes one
        `sink.write` call. The future's result is None when the body is complete; its
        exception is ConnectionBroken if the connection breaks or is closed first, or the
        exception `sink.write` raised (the connection is then closed).
        """
        if self._sink is not None:
            raise RuntimeError("pipe() called twice")
        future: asyncio.Future[None] = self._loop.create_future()
        future.add_done_callback(self._pipe_done)
        self._pipe_future = future
        self._sink = sink
        self._write_frame = getattr(sink, "write_frame", None)
        buffer = self._buffer
        if buffer.pieces:
            self._emit(buffer.take())
        if not future.done():
            if self._complete:
                future.set_result(None)
            elif self._error is not None:
                future.set_exception(self._broken())
        return future

    def pause_reading(self) -> None:
        """Stop reading from the worker (the sink is slow) until `resume_reading`."""
        buffer = self._buffer
        buffer.caller_paused = True
        buffer.switch()

    def resume_reading(self) -> None:
        """Read from the worker again after `pause_reading`."""
        buffer = self._buffer
        buffer.caller_paused = False
        buffer.switch()

    def release(self) -> None:
        """Give the connection back to its pool, or close it if it cannot be reused.

        Reused only when the whole answer arrived, the connection is open, the worker
        spoke HTTP/1.1 without `Connection: close`, and no read was cancelled. Idempotent.
        """
        if self._released:
            return
        self._released = True
        if (self._complete and self._decoder.keep_alive and self._reusable
                and not self._closed):
            self._keeper.park(self)
        else:
            self.close()

    def close(self) -> None:
        """Abort the connection at once (a generating engine sees it and stops).

        A pending head/read/pipe fails with ConnectionBroken. Idempotent.
        """
        self._released = True
        self._reusable = False
        if not self._complete and self._decoder.state != IDLE:
            self._break("closed by the caller")
        else:
            self._abort()
        if self.parked:
            self._keeper.forget(self)

    # -- asyncio.Protocol --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transport is not a subclass of asyncio.Transport
        self.transport = self._buffer.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        aborted = self._closed  # by us (`_abort`): the close is not the body's end
        self._closed = True
        self._buffer.transport = None
        self._keeper.lost(self)
        state = self._decoder.state
        if state == UNTIL_CLOSE and exc is None and not aborted and self._error is None:
            self._finish()  # the body's end
        elif not self._complete and state != IDLE:
            why = f": {exc}" if exc is not None else ""
            self._break(f"the upstream closed the connection before the answer was complete{why}")

    def eof_received(self) -> bool | None:
        return None  # close our side too; connection_lost follows

    def data_received(self, data: bytes) -> None:
        self.reads += 1  # cheaper than noting the time of every read
        decoder = self._decoder
        state = decoder.state
        if state == LENGTH:  # the common cases first, without the general parser
            left = decoder.left
            if len(data) < left:
                decoder.left = left - len(data)
                self._emit(data)
                return
            if len(data) == left:
                decoder.left = 0
                self._emit(data)
                self._finish()
                return
        elif state == UNTIL_CLOSE:
            self._emit(data)
            return
        elif state == CHUNK_SIZE and not decoder.pending:
            # Whole non-empty chunks and nothing else (a streamed token, or a few): passed
            # on as they came to a framing sink, or one chunk's payload to the others.
            payload_at = whole_chunks(data)
            write_frame = self._write_frame
            if write_frame is None:
                if payload_at > 0:  # one chunk (several: the general parser decodes them)
                    self._received_any = True
                    self._emit(data[payload_at:-2])
                    return
            elif payload_at >= 0:
                self._received_any = True
                try:
                    write_frame(data)
                except Exception as exc:
                    self._sink_failed(exc)
                return
        elif state == IDLE:  # bytes nobody asked for: the connection is out of step
            self.close()
            return
        self._received_any = True
        try:
            if state == HEAD and not decoder.head_buffer:
                # The usual small answer: its whole head and a Content-Length body in
                # one read, taken without the general parser.
                end_of_head = data.find(b"\r\n\r\n")
                if end_of_head >= 0:
                    decoder.on_head(data[:end_of_head])
                    data = data[end_of_head + 4 :]
                    if decoder.state == LENGTH and len(data) == decoder.left:
                        decoder.left = 0
                        self.status = decoder.status
                        self.headers = decoder.headers
                        self._head_ready = True  # (`_finish` wakes whoever waits for it)
                        self._emit(data)
                        self._finish()
                        return
            pieces = decoder.feed(data)
        except MalformedAnswer as exc:
            self._take_head()  # a head parsed before the fault stands
            self._break(f"malformed answer from the upstream: {exc}")
            return
        if not self._head_ready and decoder.head_ready:
            self._take_head()
        if pieces:
            self._emit(pieces[0] if len(pieces) == 1 else b"".join(pieces))
        if decoder.state == DONE and not self._complete:
            self._finish()

    def _take_head(self) -> None:
        """The final head, if the decoder has it: the caller's from now (`head`)."""
        decoder = self._decoder
        if decoder.head_ready and not self._head_ready:
            self.status = decoder.status
            self.headers = decoder.headers
            self._head_ready = True
            self._buffer.wake()

    # -- delivery --

    def _emit(self, data: bytes) -> None:
        """Hand decoded body bytes to the sink, or buffer them for a reader."""
        sink = self._sink
        if sink is not None:
            try:
                sink.write(data)
            except Exception as exc:
                self._sink_failed(exc)
            return
        self._buffer.add(data)

    def _sink_failed(self, exc: Exception) -> None:
        self._sink = self._write_frame = None
        self._reusable = False
        if self._error is None and not self._complete:
            self._error = f"the sink failed: {exc!r}"  # the answer is cut short here
        self._abort()
        future = self._pipe_future
        if future is not None and not future.done():
            future.set_exception(exc)

    def _finish(self) -> None:
        self._decoder.state = DONE
        self._complete = True
        self._buffer.wake()
        future = self._pipe_future
        if future is not None and not future.done():
            future.set_result(None)

    def _break(self, why: str) -> None:
        """The answer cannot complete: abort, and fail whoever waits."""
        self._reusable = False
        self._abort()
        if self._complete or self._error is not None:
            return
        self._error = why
        self._buffer.wake()
        future = self._pipe_future
        if future is not None and not future.done():
            future.set_exception(self._broken())

    def _broken(self) -> ConnectionBroken:
        received_any = self._received_any
        return ConnectionBroken(
            f"{self.key[0]}:{self.key[1]}: {self._error}",
            stale=self._reused and not received_any,
            received_any=received_any,
        )

    def _abort(self) -> None:
        transport = self.transport
        if transport is not None and not self._closed:
            self._closed = True
            self._buffer.transport = None
            transport.abort()

    def _pipe_done(self, future: asyncio.Future[None]) -> None:
        if future.cancelled():
            self._reusable = False
        else:
            future.exception()  # retrieved: a caller that closed need not await it

    # -- for the pool --

    def begin(self, payload: bytes, *, reused: bool) -> None:
        """Write a request and expect its answer (the pool's call: see `UpstreamPool.send`)."""
        self._reset(reused=reused)
        self._decoder.reset(no_body=payload.startswith(b"HEAD "))
        if self._closed or self.transport is None:
            self._error = "the connection closed before the request was sent"
            return
        self.transport.write(payload)

    def park(self) -> None:
        """Idle in the pool from now (the pool's call)."""
        self._decoder.state = IDLE
        self.parked = True
        self.idle_since = self.clock()
        buffer = self._buffer
        if buffer.pieces:
            buffer.take()  # a body left unread: dropped
        buffer.caller_paused = False
        if buffer.paused:
            buffer.switch()  # a peer's close or stray bytes must be noticed while idle
