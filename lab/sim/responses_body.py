"""The Responses API's bodies and SSE events in the shapes vLLM 0.32 sends
(captured: tests/fixtures/vllm-0.32-cpu-responses.json).

A response object has the same keys in the same order as vLLM's `ResponsesResponse`.
A stream is `event: <type>\\ndata: <compact json>\\n\\n` per event, numbered from 0 by
`sequence_number`, with no `data: [DONE]` at the end: response.created and
response.in_progress (status "in_progress", sent before the first token), then
output_item.added and content_part.added with the first token, one output_text.delta per
token, then output_text.done, content_part.done, output_item.done and response.completed
(whose response says "completed", or "incomplete" when max_output_tokens cut it).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any, Literal

from lab.sim.errors import compact_text
from lab.sim.sequence import FinishReason

ResponseStatus = Literal["queued", "in_progress", "completed", "incomplete", "cancelled",
                         "failed"]



def new_response_id() -> str:
    """vLLM's `resp_` + 16 hex digits."""
    return "resp_" + secrets.token_hex(8)


def new_message_id() -> str:
    return "msg_" + secrets.token_hex(8)


def status_of(reason: FinishReason | None) -> ResponseStatus:
    """A finished sequence's response status (vLLM: "incomplete" when cut by length)."""
    if reason is FinishReason.STOP:
        return "completed"
    if reason is FinishReason.LENGTH:
        return "incomplete"
    return "failed"


@dataclass(frozen=True, slots=True)
class ResponseHeader:
    """What a response object says about its request, fixed when it is created."""

    response_id: str
    created_at: int
    model: str
    max_output_tokens: int
    instructions: str | None = None
    previous_response_id: str | None = None
    background: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    metadata: Any = None
    user: str | None = None


def output_text(text: str) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": None}


def output_message(message_id: str, text: str, *, done: bool = True) -> dict[str, Any]:
    """The one assistant message of a response (no content while it is being written,
    and none for an empty answer)."""
    return {"id": message_id, "content": [output_text(text)] if done and text else [],
            "role": "assistant", "status": "completed" if done else "in_progress",
            "type": "message", "phase": None}


def responses_usage(input_tokens: int, output_tokens: int, cached_tokens: int
                    ) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0,
                                 "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                  "output_tokens_per_turn": [],
                                  "tool_output_tokens_per_turn": []},
        "total_tokens": input_tokens + output_tokens,
    }


def response_body(header: ResponseHeader, status: ResponseStatus,
                  output: list[dict[str, Any]] | None = None,
                  usage: dict[str, Any] | None = None) -> dict[str, Any]:
    """A response object (vLLM's ResponsesResponse.from_request, key for key)."""
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": header.response_id, "created_at": header.created_at,
        "incomplete_details": incomplete, "instructions": header.instructions,
        "metadata": header.metadata, "model": header.model, "object": "response",
        "output": output or [], "parallel_tool_calls": True,
        "temperature": header.temperature, "tool_choice": "none", "tools": [],
        "top_p": header.top_p, "background": header.background,
        "max_output_tokens": header.max_output_tokens, "max_tool_calls": None,
        "previous_response_id": header.previous_response_id, "prompt": None,
        "reasoning": None, "service_tier": "auto", "status": status, "text": None,
        "top_logprobs": None, "truncation": "disabled", "usage": usage, "user": header.user,
        "presence_penalty": 0.0, "frequency_penalty": 0.0, "kv_transfer_params": None,
        "ec_transfer_params": None, "input_messages": None, "output_messages": None,
    }


class ResponseEvents:
    """The SSE events of one streamed response, numbered in the order they are made."""

    def __init__(self, header: ResponseHeader) -> None:
        self._header = header
        self._message_id = new_message_id()
        self._next = 0
        # Every delta differs only in its text: built from a fixed prefix and suffix.
        self._delta_prefix = ('event: response.output_text.delta\ndata: {"content_index":0,'
                              '"delta":')
        self._delta_suffix = (f',"item_id":"{self._message_id}","logprobs":[],'
                              '"output_index":0,"sequence_number":')

    def _event(self, kind: str, data: dict[str, Any]) -> bytes:
        # vLLM's event models (the openai package's) name their fields in alphabetical order.
        data = dict(sorted({**data, "sequence_number": self._next, "type": kind}.items()))
        self._next += 1
        return f"event: {kind}\ndata: {compact_text(data)}\n\n".encode()

    def opening(self) -> list[bytes]:
        """response.created and response.in_progress: sent as soon as the request is in."""
        body = response_body(self._header, "in_progress")
        return [self._event("response.created", {"response": body}),
                self._event("response.in_progress", {"response": body})]

    def first_token(self) -> list[bytes]:
        """The message and its text part open (vLLM sends them with the first token)."""
        item = output_message(self._message_id, "", done=False)
        part = {**output_text(""), "logprobs": []}
        return [self._event("response.output_item.added", {"item": item, "output_index": 0}),
                self._event("response.content_part.added",
                            {"content_index": 0, "item_id": self._message_id,
                             "output_index": 0, "part": part})]

    def delta(self, text: str) -> bytes:
        number = self._next
        self._next += 1
        return (f"{self._delta_prefix}{compact_text(text)}{self._delta_suffix}{number},"
                '"type":"response.output_text.delta"}\n\n').encode()

    def closing(self, body: dict[str, Any]) -> list[bytes]:
        """The text, part and message done, then response.completed with the whole body
        (`final_body`'s)."""
        ids = {"content_index": 0, "item_id": self._message_id}
        message = body["output"][0]
        text = message["content"][0]["text"] if message["content"] else ""
        return [self._event("response.output_text.done",
                            {**ids, "logprobs": [], "output_index": 0, "text": text}),
                self._event("response.content_part.done",
                            {**ids, "output_index": 0, "part": output_text(text)}),
                self._event("response.output_item.done", {"item": message, "output_index": 0}),
                self._event("response.completed", {"response": body})]

    def final_body(self, text: str, status: ResponseStatus, usage: dict[str, Any]
                   ) -> dict[str, Any]:
        """The finished response object (stored, and the body of a non-streamed answer)."""
        return response_body(self._header, status, [output_message(self._message_id, text)],
                             usage)
