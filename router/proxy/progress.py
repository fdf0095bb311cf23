"""How far a streamed answer got: read from the events its client was sent.

Only read when a stream is to be continued on another worker (or every
`router.proxy.transcript.FOLD_BYTES` of a long one), never per token on the hot path.
"""

from __future__ import annotations

from typing import Any

from pydantic_core import from_json

_DONE = b"[DONE]"


def sse_data(event: bytes) -> bytes:
    """The `data:` payload of one SSE event: its data lines, each stripped, joined."""
    return b"\n".join(line[5:].strip() for line in event.replace(b"\r\n", b"\n").split(b"\n")
                      if line.startswith(b"data:"))


def error_status(error: object) -> tuple[int, str]:
    """(status, message) of the `error` object of an error event, as vLLM writes one
    (`{"message": ..., "code": 503}`): its code when that is an HTTP error status, else
    500; the message cut to 200 characters."""
    if not isinstance(error, dict):
        return 500, ""
    code = error.get("code")
    status = code if type(code) is int and 400 <= code <= 599 else 500
    return status, str(error.get("message", ""))[:200]


class Progress:
    """The identity of a streamed answer and what of it the client has.

    `unsound` says why the answer cannot be continued elsewhere (None: it can); `usage`:
    whether a chunk with usage counts was sent."""

    __slots__ = ("created", "done", "finish_reason", "id", "kind", "model", "object",
                 "role_sent", "text", "tokens", "unsound", "usage")

    def __init__(self, kind: str) -> None:
        self.kind = kind  # "chat" or "completions"
        self.id: str | None = None
        self.object: str | None = None
        self.created: int | None = None
        self.model: str | None = None
        self.text: list[str] = []
        self.tokens = 0  # events that carried text (maybe ""): one token each, as vLLM streams
        self.role_sent = False
        self.finish_reason: str | None = None
        self.done = False
        self.unsound: str | None = None
        self.usage = False

    @property
    def answer(self) -> str:
        return "".join(self.text)

    def feed(self, data: bytes) -> None:
        """Read whole events (`data` ends on an event boundary)."""
        for event in data.replace(b"\r\n", b"\n").split(b"\n\n"):
            payload = sse_data(event)
            if not payload:
                continue  # a comment, a blank, or an event without data
            if payload == _DONE:
                self.done = True
                continue
            try:
                document = from_json(payload)  # ~4x cheaper than json.loads
            except ValueError:
                self.unsound = "an event that is not JSON"
                continue
            if isinstance(document, dict):
                self._chunk(document)

    def _chunk(self, chunk: dict[str, Any]) -> None:
        if self.id is None:
            self.id = _str(chunk.get("id"))
            self.object = _str(chunk.get("object"))
            created = chunk.get("created")
            self.created = created if type(created) is int else None
            self.model = _str(chunk.get("model"))
        if isinstance(chunk.get("usage"), dict):
            self.usage = True
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            return
        for choice in choices:
            if isinstance(choice, dict):
                self._choice(choice)

    def _choice(self, choice: dict[str, Any]) -> None:
        if choice.get("index", 0) != 0:
            self.unsound = "more than one choice (n > 1)"
        if choice.get("logprobs") is not None:
            self.unsound = "logprobs: another engine's would not continue these"
        if self.kind == "chat":
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                delta = {}
            if delta.get("role") is not None:
                self.role_sent = True
            if delta.get("tool_calls"):
                self.unsound = "a tool call in progress"
            if delta.get("reasoning_content") or delta.get("reasoning"):
                self.unsound = "reasoning in progress"
            # vLLM sends a chunk per generated token, "" for one that ends inside a
            # character; the role event is not a token.
            text = None if "role" in delta else delta.get("content")
        else:
            text = choice.get("text")
        if isinstance(text, str):
            self.tokens += 1
            if text:
                self.text.append(text)
        finish = choice.get("finish_reason")
        if isinstance(finish, str):
            self.finish_reason = finish


def _str(value: object) -> str | None:
    return value if isinstance(value, str) else None
