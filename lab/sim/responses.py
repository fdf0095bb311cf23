"""Response bodies and SSE chunks in the shapes vLLM's OpenAI server sends.

Streaming chunk framing is `data: <json>\\n\\n`, ending with `data: [DONE]\\n\\n`. Per-token
chunks are built from a prefix and suffix fixed per request, so that a token costs one
`json.dumps` of its text rather than of a whole chunk dict.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

DONE = b"data: [DONE]\n\n"
SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
    }


def chat_completion(
    request_id: str, created: int, model: str, text: str, finish_reason: str, usage_: dict[str, Any]
) -> dict[str, Any]:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": text,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "tool_calls": [],
        "reasoning_content": None,
    }
    choice = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": None,
    }
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage_,
        "prompt_logprobs": None,
        "kv_transfer_params": None,
    }


def text_completion(
    request_id: str, created: int, model: str, text: str, finish_reason: str, usage_: dict[str, Any]
) -> dict[str, Any]:
    choice = {
        "index": 0,
        "text": text,
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": None,
        "prompt_logprobs": None,
    }
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage_,
        "kv_transfer_params": None,
    }


class StreamEncoder:
    """The SSE chunks of one streamed response (chat or completion)."""

    def __init__(
        self, kind: Literal["chat", "completion"], request_id: str, created: int, model: str,
        index: int = 0,
    ) -> None:
        """`index`: the choice these chunks carry (n > 1 streams one encoder per choice)."""
        self._kind = kind
        self._index = index
        object_name = "chat.completion.chunk" if kind == "chat" else "text_completion"
        self._head = (
            f'{{"id":{_dumps(request_id)},"object":"{object_name}",'
            f'"created":{created},"model":{_dumps(model)},'
        )
        if kind == "chat":
            self._token_prefix = (
                f'data: {self._head}"choices":[{{"index":{index},"delta":{{"content":')
            self._token_suffix_open = '},"logprobs":null,"finish_reason":null}]}\n\n'
            self._token_suffix_final = (
                '},"logprobs":null,"finish_reason":%s,"stop_reason":null}]}\n\n'
            )
        else:
            self._token_prefix = f'data: {self._head}"choices":[{{"index":{index},"text":'
            self._token_suffix_open = (
                ',"logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'
            )
            self._token_suffix_final = (
                ',"logprobs":null,"finish_reason":%s,"stop_reason":null}]}\n\n'
            )

    def first(self) -> bytes:
        """What precedes the first token: the assistant role delta for chat, nothing else."""
        if self._kind != "chat":
            return b""
        return (
            f'data: {self._head}"choices":[{{"index":{self._index},"delta":{{"role":"assistant",'
            '"content":""},"logprobs":null,"finish_reason":null}]}\n\n'
        ).encode()

    def token(self, text: str, finish_reason: str | None = None) -> bytes:
        if finish_reason is None:
            return (self._token_prefix + _dumps(text) + self._token_suffix_open).encode()
        suffix = self._token_suffix_final % _dumps(finish_reason)
        return (self._token_prefix + _dumps(text) + suffix).encode()

    def usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        """The final chunk of stream_options.include_usage: no choices, only usage."""
        body = _dumps(
            {
                "prompt_tokens": prompt_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "completion_tokens": completion_tokens,
            }
        )
        return ("data: " + self._head + '"choices":[],"usage":' + body + "}\n\n").encode()


def model_card(name: str, created_s: int, max_model_len: int) -> dict[str, Any]:
    """One model of GET /v1/models."""
    return {
        "id": name,
        "object": "model",
        "created": created_s,
        "owned_by": "vllm",
        "root": name,
        "parent": None,
        "max_model_len": max_model_len,
        "permission": [
            {
                "id": f"modelperm-{uuid.uuid4().hex}",
                "object": "model_permission",
                "created": created_s,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ],
    }
