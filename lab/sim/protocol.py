"""OpenAI request bodies -> one `GenerationRequest`, or an `ApiError` as vLLM would give.

Only the fields that change what the simulator does are read; sampling parameters
(temperature, top_p, ...) are accepted and ignored, as they do not change timing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lab.sim.config import SimConfig
from lab.sim.errors import ApiError
from lab.sim.tokens import Prompt, prompt_from_text, prompt_from_token_ids

# The simulator's bound on n (vLLM has none): each choice is a sequence in the engine.
MAX_CHOICES = 128


class Lenient(BaseModel):
    """A request body model that keeps fields it does not name (vLLM accepts them)."""

    model_config = ConfigDict(extra="allow")


class StreamOptions(Lenient):
    include_usage: bool | None = False


class _ContentPart(Lenient):
    type: str
    text: str | None = None


class ChatMessage(Lenient):
    role: str
    content: str | list[_ContentPart] | None = None


class _CommonRequest(Lenient):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    n: int | None = Field(default=1, ge=1)


class ChatRequest(_CommonRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class CompletionRequest(_CommonRequest):
    prompt: str | list[int] | list[str] | list[list[int]]


RequestT = TypeVar("RequestT", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """What a handler needs to run one request, whichever endpoint it came from."""

    kind: Literal["chat", "completion"]
    model: str
    prompt: Prompt
    max_tokens: int
    stream: bool
    include_usage: bool
    ignore_eos: bool
    choices: int = 1  # n: that many sequences of the same prompt (lab.sim.choices)


def parse_chat(body: bytes, config: SimConfig) -> GenerationRequest:
    request = validate_body(ChatRequest, body)
    parts: list[str] = []
    for message in request.messages:
        if isinstance(message.content, str):
            parts.append(message.content)
        elif message.content is not None:
            parts.extend(part.text for part in message.content if part.text is not None)
    prompt = prompt_from_text("\n".join(parts), config.block_size, config.seed)
    return _finish(
        request, "chat", prompt, request.max_completion_tokens or request.max_tokens, config
    )


def parse_completion(body: bytes, config: SimConfig) -> GenerationRequest:
    request = validate_body(CompletionRequest, body)
    single = _single_prompt(request.prompt)
    if isinstance(single, str):
        prompt = prompt_from_text(single, config.block_size, config.seed)
    else:
        prompt = prompt_from_token_ids(single, config.block_size, config.seed)
    return _finish(request, "completion", prompt, request.max_tokens, config)


def _single_prompt(raw: str | list[int] | list[str] | list[list[int]]) -> str | list[int]:
    """The one prompt of a request: text or token ids. Batched prompts are refused."""
    if isinstance(raw, str):
        return raw
    if raw and all(isinstance(item, int) for item in raw):
        return [item for item in raw if isinstance(item, int)]
    if len(raw) == 1:
        only = raw[0]
        if isinstance(only, str):
            return only
        if isinstance(only, list) and only:
            return only
    raise ApiError(
        HTTPStatus.BAD_REQUEST,
        "The simulator accepts exactly one non-empty prompt per request.",
        param="prompt",
    )


def validate_body(model: type[RequestT], body: bytes) -> RequestT:
    """The JSON body as `model`, or ApiError(400) naming the fields that are wrong."""
    try:
        payload: Any = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"Invalid JSON in request body: {exc}") from exc
    if not isinstance(payload, dict):
        raise ApiError(HTTPStatus.BAD_REQUEST, "The request body must be a JSON object.")
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = str(first["loc"][0]) if first["loc"] else None
        problems = "; ".join(
            f"{'.'.join(str(p) for p in error['loc']) or 'body'}: {error['msg']}"
            for error in exc.errors()
        )
        raise ApiError(HTTPStatus.BAD_REQUEST, problems, param=param) from exc


def _finish(
    request: _CommonRequest,
    kind: Literal["chat", "completion"],
    prompt: Prompt,
    max_tokens: int | None,
    config: SimConfig,
) -> GenerationRequest:
    model = request.model or config.served_model_names[0]
    if model not in config.served_model_names:
        raise ApiError(HTTPStatus.NOT_FOUND, f"The model `{model}` does not exist.", param="model")
    if (request.n or 1) > MAX_CHOICES:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"n must be at most {MAX_CHOICES}.", param="n")
    # vLLM 0.32's checks (vllm/renderers/params.py, v1/engine/input_processor.py) and
    # wording: a limit above the context is refused, a prompt that leaves no room for one
    # token is refused, and a limit past the room left is cut to it (get_max_tokens).
    limit = config.max_model_len
    if max_tokens is not None and max_tokens > limit:
        raise ApiError(
            HTTPStatus.BAD_REQUEST,
            f"max_tokens={max_tokens} cannot be greater than max_model_len={limit}. Please "
            "request fewer output tokens.", param="max_tokens",
        )
    if prompt.num_tokens > limit:
        raise ApiError(
            HTTPStatus.BAD_REQUEST,
            f"This model's maximum context length is {limit} tokens. However, your prompt "
            f"contains {prompt.num_tokens} input tokens, which exceeds this limit even "
            "without any output tokens. Please reduce the length of the input prompt.",
            param="input_tokens",
        )
    if prompt.num_tokens == limit:
        raise ApiError(
            HTTPStatus.BAD_REQUEST,
            f"The decoder prompt (length {limit}) plus the number of requested output "
            f"tokens (at least 1) is longer than the maximum model length of {limit}. "
            "Make sure that `max_model_len` is no smaller than the number of text tokens "
            "(prompt + requested output tokens).",
        )
    room = limit - prompt.num_tokens
    max_tokens = min(config.default_max_tokens if max_tokens is None else max_tokens, room)
    options = request.stream_options
    return GenerationRequest(
        kind=kind,
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        stream=bool(request.stream),
        include_usage=bool(options and options.include_usage),
        ignore_eos=request.ignore_eos,
        choices=request.n or 1,
    )
