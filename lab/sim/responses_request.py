"""A Responses API request body -> one `ResponsesTurn`, or an `ApiError` as vLLM 0.32 gives.

Only what changes what the simulator does is read: the input's text (a string, or the
text of a list of messages and their content parts), `instructions`, the earlier turns
of `previous_response_id`, `max_output_tokens`, `stream`, `store` and `background`.
Sampling parameters are accepted and echoed in the response (temperature, top_p), as
they do not change timing. The prompt is `instructions`, then the earlier turns, then the
input, so that a follow-up shares its prefix (and prefix-cache blocks) with its turn.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from pydantic import Field

from lab.sim.config import SimConfig
from lab.sim.errors import ApiError
from lab.sim.protocol import Lenient, validate_body
from lab.sim.responses_body import ResponseHeader, new_response_id
from lab.sim.responses_store import ResponseStore
from lab.sim.tokens import Prompt, prompt_from_text

# vLLM's type for its Responses API refusals (unknown ids, cancels it cannot do).
INVALID_REQUEST = "invalid_request_error"


def not_found(response_id: str) -> ApiError:
    """vLLM's answer for an id it does not hold (GET, cancel, previous_response_id)."""
    return ApiError(HTTPStatus.NOT_FOUND, f"Response with id '{response_id}' not found.",
                    param="response_id", error_type=INVALID_REQUEST)


class ResponsesRequest(Lenient):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    previous_response_id: str | None = None
    stream: bool | None = False
    store: bool | None = True
    background: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    ignore_eos: bool = False
    request_id: str | None = None  # vLLM's extra field: the response's id, if given


@dataclass(frozen=True, slots=True)
class ResponsesTurn:
    """What a handler needs to run one Responses API request.

    `conversation`: the earlier turns and this input, which this turn's stored response
    passes on (with its output) to a follow-up.
    """

    header: ResponseHeader
    prompt: Prompt
    max_tokens: int
    stream: bool
    store: bool
    background: bool
    ignore_eos: bool
    conversation: str


def input_text(value: str | list[dict[str, Any]]) -> str:
    """The text of `input`: a string, or the text of each item's content (a string or
    parts with "text"), or of a tool item's "output"."""
    if isinstance(value, str):
        return value
    texts: list[str] = []
    for item in value:
        content = item.get("content", item.get("output"))
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts.extend(part["text"] for part in content
                         if isinstance(part, dict) and isinstance(part.get("text"), str))
    return "\n".join(texts)


def parse_responses(body: bytes, config: SimConfig, store: ResponseStore) -> ResponsesTurn:
    request = validate_body(ResponsesRequest, body)
    if request.background and request.store is False:
        raise ApiError(HTTPStatus.BAD_REQUEST, "background can only be used when `store` is "
                       "true (parameter=background)", param="background")
    model = request.model or config.served_model_names[0]
    if model not in config.served_model_names:
        aliases = ", ".join(config.served_model_names)
        raise ApiError(HTTPStatus.NOT_FOUND,
                       f"The model `{model}` does not exist. Valid aliases: {aliases}.",
                       param="model")
    if request.background and not store.enabled:
        raise ApiError(HTTPStatus.BAD_REQUEST, "This vLLM engine does not support "
                       "`store=True` and therefore does not support the background mode. To "
                       "enable these features, set the environment variable "
                       "`VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server.",
                       param="background", error_type=INVALID_REQUEST)
    earlier = ""
    if request.previous_response_id is not None:
        previous = store.get(request.previous_response_id)
        if previous is None:
            raise not_found(request.previous_response_id)
        earlier = previous.conversation + "\n"
    conversation = earlier + input_text(request.input)
    text = conversation if request.instructions is None else (
        request.instructions + "\n" + conversation)
    prompt = prompt_from_text(text, config.block_size, config.seed)
    max_tokens = _max_tokens(request, prompt, config)
    return ResponsesTurn(
        header=_header(request, model, max_tokens), prompt=prompt, max_tokens=max_tokens,
        stream=bool(request.stream), store=bool(request.store) and store.enabled,
        background=bool(request.background), ignore_eos=request.ignore_eos,
        conversation=conversation)


def _max_tokens(request: ResponsesRequest, prompt: Prompt, config: SimConfig) -> int:
    """max_output_tokens, or the simulator's default_max_tokens, within the context
    (vLLM caps it the same way, and refuses a prompt that fills the context)."""
    room = config.max_model_len - prompt.num_tokens
    if room <= 0:
        raise ApiError(HTTPStatus.BAD_REQUEST,
                       f"The engine prompt length {prompt.num_tokens} exceeds the "
                       f"max_model_len {config.max_model_len}. Please reduce prompt.",
                       param="input", error_type=INVALID_REQUEST)
    return min(request.max_output_tokens or config.default_max_tokens, room)


def _header(request: ResponsesRequest, model: str, max_tokens: int) -> ResponseHeader:
    return ResponseHeader(
        response_id=request.request_id or new_response_id(), created_at=int(time.time()),
        model=model,
        max_output_tokens=max_tokens, instructions=request.instructions,
        previous_response_id=request.previous_response_id,
        background=bool(request.background),
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        metadata=request.metadata, user=request.user)
