"""Scripted workers: raw HTTP/1.1 servers on loopback that play an engine on the wire, byte
for byte, for the shapes a simulator cannot make (an event cut in half, events coalesced in
one read, a tool call). A scripted worker is not project code: it stands where vLLM would.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

SECRET = "engine 10.9.8.7:8000 CUDA error: an illegal memory access"
SSE_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
REFUSAL = b'{"error":{"message":"refused","type":"BadRequestError","code":400}}'

Play = Callable[[int, str, dict[str, Any], asyncio.StreamWriter], Awaitable[bool]]


def sse(chunk: dict[str, Any]) -> bytes:
    """One server-sent event, compact as vLLM writes it."""
    return b"data: " + json.dumps(chunk, separators=(",", ":"), ensure_ascii=False
                                  ).encode() + b"\n\n"


def http_chunk(payload: bytes) -> bytes:
    """`payload` framed as one chunk of a chunked HTTP/1.1 body."""
    return b"%x\r\n" % len(payload) + payload + b"\r\n"


def chat_chunk(content: str | None = None, *, role: bool = False, finish: str | None = None,
               tool: dict[str, Any] | None = None, rid: str = "chatcmpl-first",
               created: int = 1_700_000_000) -> bytes:
    """A chat.completion.chunk event: the role event, a token, or a tool call's delta."""
    delta: dict[str, Any] = {}
    if role:
        delta = {"role": "assistant", "content": ""}
    elif content is not None:
        delta = {"content": content}
    if tool is not None:
        delta = {"tool_calls": [tool]}
    return sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": "m",
                "choices": [{"index": 0, "delta": delta, "logprobs": None,
                             "finish_reason": finish}]})


def error_event(message: str = SECRET, code: int = 500) -> bytes:
    """The error event vLLM sends in the stream when its engine dies."""
    return sse({"error": {"message": message, "type": "InternalServerError", "code": code}})


# The start of a chat stream: the role event and " t1" in one chunk, then " t2" in its own.
ROLE_T1 = SSE_HEAD + http_chunk(chat_chunk(role=True) + chat_chunk(" t1"))
T2 = http_chunk(chat_chunk(" t2"))


@dataclass
class Scripted:
    """A raw HTTP/1.1 worker: each request's body is kept, and `play(n, path, body,
    writer)` answers it (True: keep the connection for another request)."""

    play: Play
    url: str = ""
    bodies: list[dict[str, Any]] = field(default_factory=list)
    server: asyncio.AbstractServer | None = None
    writers: set[asyncio.StreamWriter] = field(default_factory=set)

    async def start(self) -> Scripted:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.add(writer)
        try:
            for _ in range(20):
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ", 2)[1].decode()
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, rest = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(rest)
                body = json.loads(await reader.readexactly(length)) if length else {}
                self.bodies.append(body)
                if not await self.play(len(self.bodies) - 1, path, body, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            self.writers.discard(writer)
            writer.close()

    async def stop(self) -> None:
        for writer in list(self.writers):
            writer.transport.abort()
        if self.server is not None:
            self.server.close()


async def send(writer: asyncio.StreamWriter, data: bytes, pause_s: float = 0.03) -> None:
    """Write `data` as one write, and give the router time to read it alone."""
    writer.write(data)
    await writer.drain()
    await asyncio.sleep(pause_s)


def playing(*writes: bytes, linger_s: float = 0.0, keep: bool = False) -> Play:
    """A worker that answers any request with `writes`, each one write read alone, then
    waits `linger_s` and closes the connection (or keeps it, if `keep`)."""

    async def play(n: int, path: str, request: dict[str, Any],
                   writer: asyncio.StreamWriter) -> bool:
        for data in writes:
            await send(writer, data)
        await asyncio.sleep(linger_s)
        return keep

    return play


def continuation_events(path: str, request: dict[str, Any]) -> list[bytes]:
    """A whole answer as vLLM would shape it, framed: a role event (chat), `max_tokens`
    tokens " c<i>", a `length` finish, usage if asked, [DONE] and the last chunk."""
    limit = request.get("max_completion_tokens") or request.get("max_tokens") or 16
    chat = path.endswith("/chat/completions")
    rid, created = "other-id", 1_800_000_000
    events = [SSE_HEAD]
    if chat:
        events.append(http_chunk(chat_chunk(role=True, rid=rid, created=created)))
    for i in range(limit):
        finish = "length" if i == limit - 1 else None
        if chat:
            event = chat_chunk(f" c{i}", finish=finish, rid=rid, created=created)
        else:
            event = sse({"id": rid, "object": "text_completion", "created": created,
                         "model": "m", "choices": [{"index": 0, "text": f" c{i}",
                                                    "logprobs": None,
                                                    "finish_reason": finish}]})
        events.append(http_chunk(event))
    if (request.get("stream_options") or {}).get("include_usage"):
        events.append(http_chunk(sse({
            "id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": "m", "choices": [],
            "usage": {"prompt_tokens": 40, "completion_tokens": limit,
                      "total_tokens": 40 + limit}})))
    events.append(http_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    return events


def continuation_answer(counter: list[int] | None = None) -> Play:
    """A worker that continues whatever it is asked (`continuation_events`). With a
    `counter` shared by several, the first request any of them gets is refused (400)."""

    async def play(n: int, path: str, request: dict[str, Any],
                   writer: asyncio.StreamWriter) -> bool:
        if counter is not None:
            counter[0] += 1
            if counter[0] == 1:  # the first continuation asked of any of these: refused
                writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n" % len(REFUSAL) + REFUSAL)
                await writer.drain()
                return True
        for piece in continuation_events(path, request):
            writer.write(piece)
            await writer.drain()
        return True

    return play
