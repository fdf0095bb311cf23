"""Validate the little of an OpenAI request body that routing needs; the engine checks the rest."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from router.proxy.errors import ApiError

CHARS_PER_TOKEN = 4  # a cheap, tokenizer-free estimate; only relative sizes matter


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    model: str
    stream: bool
    prompt_tokens: int


def _text_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        total = 0
        for part in content:
            if isinstance(part, str):
                total += len(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                total += len(part["text"])
        return total
    return 0


def parse_body(body: bytes, kind: str) -> ParsedRequest:
    """`kind` is "chat", "completions" or "embeddings". Raises ApiError(400) on bad input."""
    if not body:
        raise ApiError(400, "request body is empty; expected a JSON object")
    try:
        document = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(document, dict):
        raise ApiError(400, "request body must be a JSON object")
    model = document.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required and must be a non-empty string", param="model")
    stream = document.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be true or false", param="stream")
    if kind == "chat":
        messages = document.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' is required and must be a non-empty array",
                           param="messages")
        chars = 0
        for message in messages:
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ApiError(400, "each message must be an object with a 'role'",
                               param="messages")
            chars += _text_chars(message.get("content"))
    elif kind == "completions":
        if "prompt" not in document:
            raise ApiError(400, "'prompt' is required", param="prompt")
        chars = _text_chars(document["prompt"])
    else:
        if "input" not in document:
            raise ApiError(400, "'input' is required", param="input")
        chars = _text_chars(document["input"])
    return ParsedRequest(model=model, stream=stream, prompt_tokens=max(1, chars // CHARS_PER_TOKEN))
