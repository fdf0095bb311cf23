"""A fake OpenAI backend cheap enough not to dominate a proxy benchmark.

A raw asyncio Protocol (on uvloop) with responses encoded once per token count: no HTTP
framework, no JSON parsing. It answers

- `POST /v1/chat/completions`, `/v1/completions`: `max_tokens` tokens (default 16), as
  one JSON answer, or with `"stream": true` as SSE events in HTTP/1.1 chunked encoding
  (one chunk per event, then a usage chunk and `data: [DONE]`);
- `GET /health`, `/v1/models`, `/get_model_info`, `/get_server_info`, ... : 200 JSON,
  so that routers that probe their workers at start accept it;
- `GET /bench/connections`: connections accepted so far (all ports), so the benchmark
  can tell whether a router reuses its upstream connections.

`--distinct-headers` gives every answer header lines no answer had before (a Date one
second after the last one's, an X-Request-Id, an X-Seq): what hours of traffic show a
router's tables of known header lines, in a minute (`globalpool bench-memory`).
`--tls-cert`/`--tls-key` serve https instead of http.

Inter-token delay is chosen by the request's model name (`--delay-ms MODEL=MS`), because
the model field is the one knob every router forwards unchanged. With no delay each token
is still written separately, one per event-loop turn, as an engine emits them. So is the
size of each token's event (`--token-chars MODEL=N`: N characters of content instead of
`tok `), for events as large as an engine's with logprobs.

    python -m lab.benchproxy.backend --port 9001 --port 9002 --delay-ms bench-paced=10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import ssl
import time
from collections.abc import Callable
from email.utils import formatdate
from typing import Any, cast

from router.event_loop import new_event_loop

# sglang-router re-serialises the body with `max_completion_tokens` instead.
_MAX_TOKENS = re.compile(rb'"max_(?:completion_)?tokens"\s*:\s*(\d+)')
_STREAM_TRUE = re.compile(rb'"stream"\s*:\s*true')
_MODEL = re.compile(rb'"model"\s*:\s*"([^"]*)"')
_CREATED = 1_700_000_000
DEFAULT_TOKENS = 16
MAX_TOKENS = 4096


def _json(document: Any) -> bytes:
    return json.dumps(document, separators=(",", ":")).encode()


def _chunk(payload: bytes) -> bytes:
    """One HTTP/1.1 chunk."""
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _event(document: Any) -> bytes:
    return _chunk(b"data: " + _json(document) + b"\n\n")


class Responses:
    """Pre-encoded answers, built once per (model, token count) and kept."""

    def __init__(self, token_chars: dict[bytes, int] | None = None) -> None:
        self._unary: dict[tuple[bytes, int], bytes] = {}
        self._stream: dict[tuple[bytes, int], tuple[bytes, bytes, bytes]] = {}
        self._token_chars = token_chars or {}  # per model: a streamed token's content size

    def unary(self, model: bytes, tokens: int) -> bytes:
        key = (model, tokens)
        cached = self._unary.get(key)
        if cached is None:
            body = _json({
                "id": "chatcmpl-bench", "object": "chat.completion", "created": _CREATED,
                "model": model.decode(), "choices": [{
                    "index": 0, "finish_reason": "stop",
                    "message": {"role": "assistant", "content": "tok " * tokens}}],
                "usage": {"prompt_tokens": 8, "completion_tokens": tokens,
                          "total_tokens": 8 + tokens},
            })
            cached = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            self._unary[key] = cached
        return cached

    def stream(self, model: bytes, tokens: int) -> tuple[bytes, bytes, bytes]:
        """(headers + first token, each further token, usage + [DONE] + last chunk)."""
        key = (model, tokens)
        cached = self._stream.get(key)
        if cached is None:
            name = model.decode()
            chars = self._token_chars.get(model)
            content = "tok " if chars is None else ("tok " * (chars // 4 + 1))[:chars]
            token = _event({
                "id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": _CREATED,
                "model": name,
                "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}],
            })
            tail = _event({
                "id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": _CREATED,
                "model": name, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 8, "completion_tokens": tokens,
                          "total_tokens": 8 + tokens},
            }) + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
            head = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                    b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n")
            cached = (head + token, token, tail)
            self._stream[key] = cached
        return cached


class DistinctHeaders:
    """Header lines for each answer that no answer had before (`--distinct-headers`)."""

    def __init__(self, first_date_s: int) -> None:
        self._answers = 0
        self._first_date_s = first_date_s

    def add(self, answer: bytes) -> bytes:
        """`answer` with a new Date, X-Request-Id and X-Seq after its status line."""
        self._answers += 1
        seq = self._answers
        lines = (f"Date: {formatdate(self._first_date_s + seq, usegmt=True)}\r\n"
                 f"X-Request-Id: backend-{seq:x}\r\nX-Seq: {seq}\r\n").encode()
        status_end = answer.index(b"\r\n") + 2
        return answer[:status_end] + lines + answer[status_end:]


class Counters:
    """What the benchmark asks the backends about itself (GET /bench/connections)."""

    accepted = 0


def _get_answer(path: bytes, models: list[str]) -> bytes:
    if path.startswith(b"/bench/connections"):
        body = _json({"accepted": Counters.accepted})
    elif path.startswith(b"/v1/models"):
        body = _json({"object": "list", "data": [
            {"id": m, "object": "model", "created": _CREATED, "owned_by": "bench"}
            for m in models]})
    elif path.startswith(b"/get_model_info"):
        body = _json({"model_path": models[0], "tokenizer_path": models[0],
                      "is_generation": True})
    else:  # /health, /health_generate, /get_server_info, /version, ...
        body = b"{}"
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))


def _dechunk(buffer: bytearray, start: int) -> tuple[bytes, int] | None:
    """A chunked request body starting at `start`: (body, end offset) or None if partial."""
    body = bytearray()
    position = start
    while True:
        line_end = buffer.find(b"\r\n", position)
        if line_end < 0:
            return None
        size = int(bytes(buffer[position:line_end]).split(b";")[0], 16)
        position = line_end + 2
        if size == 0:
            trailer_end = buffer.find(b"\r\n\r\n", position - 2)
            return (bytes(body), trailer_end + 4) if trailer_end >= 0 else None
        if len(buffer) < position + size + 2:
            return None
        body += buffer[position : position + size]
        position += size + 2


class BackendProtocol(asyncio.Protocol):
    """One client connection: HTTP/1.1 keep-alive, requests answered in order."""

    def __init__(self, responses: Responses, delays_s: dict[bytes, float],
                 models: list[str], distinct: DistinctHeaders | None = None) -> None:
        self._distinct = distinct
        self._responses = responses
        self._delays_s = delays_s
        self._models = models
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None
        self._busy = False  # a stream is being written; later requests wait
        self._close_after = False
        self._timer: asyncio.TimerHandle | asyncio.Handle | None = None
        self._loop = asyncio.get_running_loop()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        Counters.accepted += 1

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._transport = None

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if not self._busy:
            self._serve_buffered()

    def _serve_buffered(self) -> None:
        buffer = self._buffer
        while not self._busy and self._transport is not None:
            header_end = buffer.find(b"\r\n\r\n")
            if header_end < 0:
                return
            head = bytes(buffer[:header_end]).lower()
            body_start = header_end + 4
            length_at = head.find(b"\r\ncontent-length:")
            if length_at >= 0:
                value_end = head.find(b"\r\n", length_at + 2)
                length = int(head[length_at + 17 : value_end if value_end >= 0 else None])
                if len(buffer) < body_start + length:
                    return
                body = bytes(buffer[body_start : body_start + length])
                end = body_start + length
            elif b"\r\ntransfer-encoding: chunked" in head:
                parsed = _dechunk(buffer, body_start)
                if parsed is None:
                    return
                body, end = parsed
            else:
                body, end = b"", body_start
            del buffer[:end]
            self._close_after = b"\r\nconnection: close" in head
            method, _, rest = head.partition(b" ")
            path = rest.partition(b" ")[0]
            self._answer(method, path, body)

    def _answer(self, method: bytes, path: bytes, body: bytes) -> None:
        transport = self._transport
        assert transport is not None
        if method != b"post":
            transport.write(_get_answer(path, self._models))
            self._finish()
            return
        found = _MAX_TOKENS.search(body)
        tokens = min(MAX_TOKENS, max(1, int(found.group(1)))) if found else DEFAULT_TOKENS
        named = _MODEL.search(body)
        model = named.group(1) if named else b"bench"
        if _STREAM_TRUE.search(body) is None:
            transport.write(self._headed(self._responses.unary(model, tokens)))
            self._finish()
            return
        first, token, tail = self._responses.stream(model, tokens)
        delay_s = self._delays_s.get(model, 0.0)
        transport.write(self._headed(first))
        self._busy = True
        self._next_token(token, tail, tokens - 1, delay_s)

    def _headed(self, answer: bytes) -> bytes:
        return answer if self._distinct is None else self._distinct.add(answer)

    def _next_token(self, token: bytes, tail: bytes, left: int, delay_s: float) -> None:
        step: Callable[[], None]
        if left <= 0:
            step = lambda: self._end_stream(tail)  # noqa: E731
        else:
            step = lambda: self._write_token(token, tail, left, delay_s)  # noqa: E731
        if delay_s > 0:
            self._timer = self._loop.call_later(delay_s, step)
        else:
            self._timer = self._loop.call_soon(step)

    def _write_token(self, token: bytes, tail: bytes, left: int, delay_s: float) -> None:
        if self._transport is None:
            return
        self._transport.write(token)
        self._next_token(token, tail, left - 1, delay_s)

    def _end_stream(self, tail: bytes) -> None:
        self._timer = None
        if self._transport is None:
            return
        self._transport.write(tail)
        self._busy = False
        self._finish()
        if self._buffer and self._transport is not None:
            self._serve_buffered()

    def _finish(self) -> None:
        if self._close_after and self._transport is not None:
            self._transport.close()


async def serve(ports: list[int], delays_ms: dict[str, float], models: list[str],
                host: str = "127.0.0.1", token_chars: dict[str, int] | None = None, *,
                distinct_headers: bool = False, tls: ssl.SSLContext | None = None) -> None:
    """Listen on every port until SIGTERM/SIGINT; prints `ready` once all are bound.
    `token_chars`: per model, the content size of each streamed token (default `tok `).
    `distinct_headers`: see DistinctHeaders; `tls`: serve https with this context."""
    loop = asyncio.get_running_loop()
    distinct = DistinctHeaders(int(time.time())) if distinct_headers else None
    responses = Responses({name.encode(): n for name, n in (token_chars or {}).items()})
    delays_s = {name.encode(): ms / 1000.0 for name, ms in delays_ms.items()}
    servers = [
        await loop.create_server(lambda: BackendProtocol(responses, delays_s, models, distinct),
                                 host, port, backlog=4096, ssl=tls)
        for port in ports
    ]
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    print("ready", flush=True)
    await stop.wait()
    for server in servers:
        server.close()


def _server_tls(cert: str | None, key: str | None) -> ssl.SSLContext | None:
    if cert is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    return context


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, action="append", required=True)
    parser.add_argument("--distinct-headers", action="store_true",
                        help="new Date, X-Request-Id and X-Seq lines in every answer")
    parser.add_argument("--tls-cert", default=None, help="serve https: certificate (PEM)")
    parser.add_argument("--tls-key", default=None, help="its private key (PEM)")
    parser.add_argument("--delay-ms", action="append", default=[], metavar="MODEL=MS",
                        help="inter-token delay for requests naming MODEL")
    parser.add_argument("--model", action="append", default=None,
                        help="model names listed by /v1/models (default: bench)")
    parser.add_argument("--token-chars", action="append", default=[], metavar="MODEL=N",
                        help="characters of content per streamed token for requests naming "
                        "MODEL (default: 4)")
    args = parser.parse_args()
    delays = {}
    for item in args.delay_ms:
        name, _, ms = item.partition("=")
        delays[name] = float(ms)
    models = args.model or ["bench", *delays]
    token_chars = {name: int(n) for name, _, n in
                   (item.partition("=") for item in args.token_chars)}
    loop = new_event_loop()
    try:
        loop.run_until_complete(serve(
            args.port, delays, models, args.host, token_chars,
            distinct_headers=args.distinct_headers, tls=_server_tls(args.tls_cert, args.tls_key)))
    finally:
        loop.close()


if __name__ == "__main__":
    main()
