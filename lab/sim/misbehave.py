"""Completion requests answered wrongly on purpose: worker faults at the HTTP and TCP level.

`WrongAnswer(...).play(mode)` answers one parsed request the way the `misbehave` knob says
(each mode is described on `FaultKnobs.misbehave`). Modes that break HTTP write their bytes
to the connection's transport themselves, then close or reset it and park the handler
until aiohttp sees the connection go (which cancels the handler: serve with handler
cancellation on, as `SimServer` does) or the server stops (`SimHandlers.release_parked`),
so aiohttp never writes on such a connection again. Modes that are valid HTTP, only slow or
endless, use aiohttp's responses. Nothing here starts a task: a mode runs in its request's
handler and ends with it, so a client that goes away ends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import random
import socket
import struct
import time
import uuid
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Protocol

from aiohttp import web

from lab.sim.errors import ApiError
from lab.sim.faults import FaultKnobs, Misbehaviour
from lab.sim.protocol import GenerationRequest
from lab.sim.responses import DONE, StreamEncoder, chat_completion, text_completion, usage


class Park(Protocol):
    """Waits until the server stops (raising CancelledError), or `timeout_s` has passed:
    a mode's waits end at shutdown instead of holding it up."""

    def __call__(self, timeout_s: float | None = None) -> Awaitable[None]: ...


HUGE_HEADERS_BYTES = 10 * 1024 * 1024
GARBAGE_BYTES = 4096
LENGTH_ERROR_BYTES = 100  # how far wrong_/short_content_length's Content-Length is off
RESET_AFTER_TOKENS = 3
ENDLESS_CHUNK_INTERVAL_S = 0.01
LIED_CONTEXT = 1_000_000_000  # the context too_long_lie names
# A reset discards what the kernel has not sent yet, so the tokens written before it get
# this long to reach the client (on loopback they are there at once).
_FLUSH_BEFORE_RESET_S = 0.05
# huge_headers writes while the client takes at most this much behind: the simulator does
# not hold 10 MB per request for a client that stopped reading.
_WRITE_AHEAD_BYTES = 256 * 1024
_WRITE_PIECE_BYTES = 64 * 1024
_WRITE_POLL_S = 0.01
_SSE = "text/event-stream; charset=utf-8"
_JSON = "application/json"
_WORD = " word"


@functools.cache
def _filler_headers() -> bytes:
    """HUGE_HEADERS_BYTES of header lines (built once)."""
    line = b"X-Sim-Filler: " + b"x" * 1000 + b"\r\n"
    return line * (HUGE_HEADERS_BYTES // len(line) + 1)


@functools.cache
def _garbage() -> bytes:
    """Seeded bytes that no HTTP parser takes for a status line (built once)."""
    return b"\x00\xff\x16\x03" + random.Random(0).randbytes(GARBAGE_BYTES - 4)


def _head(content_type: str, framing: str, extra: bytes = b"") -> bytes:
    return (f"HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\n{framing}\r\n".encode()
            + extra + b"\r\n")


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _reset(transport: asyncio.Transport) -> None:
    """Close with a TCP RST, not a FIN: SO_LINGER 0, then abort."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


class WrongAnswer:
    """The wrong answer to one request: `await WrongAnswer(...).play(mode)`."""

    def __init__(self, request: web.Request, generation: GenerationRequest, knobs: FaultKnobs,
                 park: Park) -> None:
        self._request = request
        self._generation = generation
        self._knobs = knobs
        self._park = park
        prefix = "chatcmpl-" if generation.kind == "chat" else "cmpl-"
        self._request_id = prefix + uuid.uuid4().hex
        self._created_s = int(time.time())

    async def play(self, mode: Misbehaviour) -> web.StreamResponse:
        """Answer as `mode` says (not "none"); returns when the client went away or the
        answer ended."""
        if mode == "none":
            raise ValueError("misbehave=none: answer the request the normal way")
        transport = self._request.transport
        if transport is None or transport.is_closing():
            return web.Response()  # the client has gone already: nothing to answer
        try:
            return await _PLAYS[mode](self, transport)
        except ConnectionResetError:  # the client went away mid-answer
            return web.Response()

    # --- the answer's parts -----------------------------------------------------------
    def _answer(self) -> bytes:
        """The whole non-streaming answer, as a healthy engine would send it."""
        generation = self._generation
        build = chat_completion if generation.kind == "chat" else text_completion
        body = build(self._request_id, self._created_s, generation.model,
                     _WORD * generation.max_tokens, "length",
                     usage(generation.prompt.num_tokens, generation.max_tokens))
        return json.dumps(body, separators=(",", ":")).encode()

    def _encoder(self) -> StreamEncoder:
        generation = self._generation
        return StreamEncoder(generation.kind, self._request_id, self._created_s, generation.model)

    def _events(self) -> list[bytes]:
        """The stream's events: the first (with the role chunk of a chat), one per further
        token, `data: [DONE]`."""
        encoder = self._encoder()
        count = self._generation.max_tokens
        tokens = [encoder.token(_WORD, "length" if i == count - 1 else None)
                  for i in range(count)]
        return [encoder.first() + tokens[0], *tokens[1:], DONE]

    def _whole(self) -> tuple[str, bytes]:
        """Content type and body of the answer sent in one piece (Content-Length)."""
        if self._generation.stream:
            return _SSE, b"".join(self._events())
        return _JSON, self._answer()

    async def _close_and_park(self, transport: asyncio.Transport, *, reset: bool = False
                              ) -> web.StreamResponse:
        """End the connection (FIN after what was written, or RST) and wait to be cancelled."""
        if reset:
            await asyncio.sleep(_FLUSH_BEFORE_RESET_S)
            _reset(transport)
        else:
            transport.close()
        await self._park()
        return web.Response()  # not reached: the park ends by cancellation

    async def _write_paced(self, transport: asyncio.Transport, data: bytes) -> None:
        """Write `data` no further ahead of the client than _WRITE_AHEAD_BYTES."""
        view = memoryview(data)
        for start in range(0, len(view), _WRITE_PIECE_BYTES):
            while transport.get_write_buffer_size() > _WRITE_AHEAD_BYTES:
                if transport.is_closing():
                    raise ConnectionResetError("the client went away")
                await self._park(_WRITE_POLL_S)
            transport.write(view[start:start + _WRITE_PIECE_BYTES])

    # --- the modes ----------------------------------------------------------------------
    async def no_answer(self, transport: asyncio.Transport) -> web.StreamResponse:
        await self._park()
        return web.Response()  # not reached

    async def headers_then_hang(self, transport: asyncio.Transport) -> web.StreamResponse:
        if self._generation.stream:
            transport.write(_head(_SSE, "Transfer-Encoding: chunked"))
        else:
            transport.write(_head(_JSON, f"Content-Length: {len(self._answer())}"))
        await self._park()
        return web.Response()  # not reached

    async def half_body_close(self, transport: asyncio.Transport) -> web.StreamResponse:
        if self._generation.stream:
            first = self._events()[0]
            transport.write(_head(_SSE, "Transfer-Encoding: chunked")
                            + _chunk(first[:len(first) // 2]))
        else:
            answer = self._answer()
            transport.write(_head(_JSON, f"Content-Length: {len(answer)}")
                            + answer[:len(answer) // 2])
        return await self._close_and_park(transport)

    async def wrong_content_length(self, transport: asyncio.Transport
                                   ) -> web.StreamResponse:
        content_type, body = self._whole()
        transport.write(_head(content_type, f"Content-Length: {len(body) + LENGTH_ERROR_BYTES}")
                        + body)
        return await self._close_and_park(transport)

    async def short_content_length(self, transport: asyncio.Transport
                                   ) -> web.StreamResponse:
        content_type, body = self._whole()
        declared = max(0, len(body) - LENGTH_ERROR_BYTES)
        transport.write(_head(content_type, f"Content-Length: {declared}") + body)
        await self._park()  # the extra bytes wait on the open connection for the next answer
        return web.Response()  # not reached

    async def huge_headers(self, transport: asyncio.Transport) -> web.StreamResponse:
        content_type, body = self._whole()
        head = _head(content_type, f"Content-Length: {len(body)}")
        status_line, rest = head.split(b"\r\n", 1)
        transport.write(status_line + b"\r\n")
        await self._write_paced(transport, _filler_headers())
        transport.write(rest + body)
        return await self._close_and_park(transport)

    async def endless_body(self, transport: asyncio.Transport) -> web.StreamResponse:
        stream = self._generation.stream
        response = web.StreamResponse(headers={"Content-Type": _SSE if stream else _JSON})
        await response.prepare(self._request)
        if stream:
            encoder = self._encoder()
            await response.write(encoder.first())
            piece = encoder.token(_WORD)
        else:
            await response.write(self._answer().split(_WORD.encode(), 1)[0])
            piece = _WORD.encode()
        while True:  # until a write fails or the handler is cancelled: the client went away
            await response.write(piece)
            await self._park(ENDLESS_CHUNK_INTERVAL_S)

    async def garbage(self, transport: asyncio.Transport) -> web.StreamResponse:
        transport.write(_garbage())
        return await self._close_and_park(transport)

    async def too_long_lie(self, _transport: asyncio.Transport) -> web.StreamResponse:
        return ApiError(HTTPStatus.BAD_REQUEST, (
            f"This model's maximum context length is {LIED_CONTEXT} tokens. However, your "
            f"prompt contains {LIED_CONTEXT + 1} input tokens, which exceeds this limit "
            "even without any output tokens. Please reduce the length of the input prompt."),
            param="input_tokens").response()

    async def reset_mid_stream(self, transport: asyncio.Transport) -> web.StreamResponse:
        if self._generation.stream:
            response = web.StreamResponse(headers={"Content-Type": _SSE})
            await response.prepare(self._request)
            for event in self._events()[:RESET_AFTER_TOKENS]:
                await response.write(event)
        else:
            answer = self._answer()
            transport.write(_head(_JSON, f"Content-Length: {len(answer)}")
                            + answer[:len(answer) // 2])
        return await self._close_and_park(transport, reset=True)

    async def slow_tokens(self, transport: asyncio.Transport) -> web.StreamResponse:
        interval_s = self._knobs.slow_token_interval_s
        if not self._generation.stream:
            await self._park(interval_s * self._generation.max_tokens)
            return web.Response(body=self._answer(), content_type=_JSON)
        response = web.StreamResponse(headers={"Content-Type": _SSE})
        await response.prepare(self._request)  # headers at once, as vLLM sends them
        *tokens, done = self._events()
        for event in tokens:
            await self._park(interval_s)
            await response.write(event)
        await response.write(done)
        await response.write_eof()
        return response


_Play = Callable[[WrongAnswer, asyncio.Transport], Awaitable[web.StreamResponse]]
_PLAYS: dict[str, _Play] = {
    "no_answer": WrongAnswer.no_answer,
    "headers_then_hang": WrongAnswer.headers_then_hang,
    "half_body_close": WrongAnswer.half_body_close,
    "wrong_content_length": WrongAnswer.wrong_content_length,
    "short_content_length": WrongAnswer.short_content_length,
    "huge_headers": WrongAnswer.huge_headers,
    "endless_body": WrongAnswer.endless_body,
    "garbage": WrongAnswer.garbage,
    "reset_mid_stream": WrongAnswer.reset_mid_stream,
    "slow_tokens": WrongAnswer.slow_tokens,
    "too_long_lie": WrongAnswer.too_long_lie,
}
