"""Validate the little of an OpenAI request body that routing needs; the engine checks the rest."""

from __future__ import annotations

import json
import zlib
from typing import Any, NamedTuple

from pydantic_core import SchemaValidator, ValidationError, core_schema, from_json

from router.core.errors import ApiError

CHARS_PER_TOKEN = 4  # a cheap, tokenizer-free estimate; only relative sizes matter
# Prefix keys: one of the prompt's first PREFIX_CHARS characters (its UTF-8 bytes), one of
# twice as many, and so on while the prompt is that long, up to PREFIX_LEVELS keys (128k
# bytes, about 32k tokens). A worker that served a prompt holds its prefix in its KV
# cache: the longest key that another request shares with it says how much of that
# request's prompt it finds cached there (router.policy.affinity).
PREFIX_CHARS = 1024
PREFIX_TOKENS = PREFIX_CHARS // CHARS_PER_TOKEN
PREFIX_LEVELS = 8
PREFIX_MAX_CHARS = PREFIX_CHARS << (PREFIX_LEVELS - 1)


def prefix_level_tokens(level: int) -> int:
    """The prompt tokens that prefix key number `level` (from 0) covers."""
    return PREFIX_TOKENS << level


def _text_head(content: Any, head: list[str], room: int) -> int:
    """Append up to `room` characters of `content`'s text to `head`; returns what is left."""
    if isinstance(content, str):
        head.append(content[:room])
        return room - len(head[-1])
    if isinstance(content, list):
        for part in content:
            if room <= 0:
                break
            text = part if isinstance(part, str) else (
                part.get("text") if isinstance(part, dict) else None)
            if isinstance(text, str):
                head.append(text[:room])
                room -= len(head[-1])
    return room


def prefix_keys_of(contents: list[Any]) -> tuple[int, ...]:
    """The keys of the contents' (joined) first PREFIX_CHARS, 2 x PREFIX_CHARS, ... bytes,
    shortest first, as many as the text is long (none for a short one). One CRC pass over
    at most PREFIX_MAX_CHARS: each key continues the one before."""
    head: list[str] = []
    room = PREFIX_MAX_CHARS
    for content in contents:
        room = _text_head(content, head, room)
        if room <= 0:
            break
    text = memoryview("\x1f".join(head).encode("utf-8", "surrogatepass"))
    keys: list[int] = []
    key = 0
    start = 0
    end = PREFIX_CHARS
    while end <= len(text):
        key = zlib.crc32(text[start:end], key)
        keys.append(key)
        start = end
        end <<= 1
    return tuple(keys)


class ParsedRequest(NamedTuple):
    model: str
    stream: bool
    prompt_tokens: int
    # max_tokens (or max_completion_tokens) times n; None when the request names none.
    completion_tokens: int | None = None
    # Keys of the prompt's first PREFIX_CHARS characters, twice as many, ... as far as the
    # prompt is long (`prefix_keys_of`; none when it is shorter): requests sharing a long
    # prefix (system prompt, few-shot examples, a document) share its keys, and a worker
    # that served one has that prefix in its KV cache.
    prefix_keys: tuple[int, ...] = ()
    choices: int = 1  # n
    # The Responses API (kind "responses"): the stored response this one continues, and
    # whether the engine stores this one (`store`, true unless the body says false).
    previous_response_id: str | None = None
    store: bool = False


def nesting_depth_exceeds(document: Any, limit: int) -> bool:
    """Whether arrays/objects in `document` nest deeper than `limit` (iterative: a deep
    document cannot exhaust the stack)."""
    stack: list[tuple[Any, int]] = [(document, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children: Any = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children
                     if isinstance(child, dict | list))
    return False


# vLLM's request models read integer fields with pydantic's lax rules: 2000.0, "2000" and
# " 2_000 " are 2000 to the engine, so they are to the router's token charges too.
_LAX_INT = SchemaValidator(core_schema.int_schema())


def lax_int(value: Any) -> int | None:
    """`value` as vLLM's pydantic reads an integer field; None for null or what it refuses
    (the engine answers that request 400 itself)."""
    if type(value) is int or value is None:
        return value
    try:
        return int(_LAX_INT.validate_python(value))
    except ValidationError:
        return None


def token_limit(document: dict[str, Any]) -> int | None:
    """The completion tokens a request asks for, as vLLM reads them: `max_completion_tokens
    or max_tokens` (a null or 0 falls through), each a lax integer; None when neither
    says one (or says what the engine refuses)."""
    value = document.get("max_completion_tokens")
    limit: int | None = value if type(value) is int else lax_int(value)  # (int: no call)
    if not limit:
        value = document.get("max_tokens")
        limit = value if type(value) is int else lax_int(value)
    return limit


def _requested_tokens(document: dict[str, Any], choices: int) -> int | None:
    limit = token_limit(document)
    if limit is None or limit < 0:
        return None
    return limit * choices


def _choices(document: dict[str, Any]) -> int:
    """`n` as the engine reads it; 1 for null or what the engine refuses (n < 1, 2.5)."""
    value = document.get("n", 1)
    choices: int | None = value if type(value) is int else lax_int(value)
    if choices is None or choices < 1:
        return 1
    return choices


def _text_chars(content: Any) -> int:
    """Characters of text in `content`: a string, text parts, or prompts (a token id counts
    as CHARS_PER_TOKEN: the completions API takes prompts as lists of them)."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        total = 0
        for part in content:
            if isinstance(part, str):
                total += len(part)
            elif type(part) is int:
                total += CHARS_PER_TOKEN
            elif isinstance(part, list):  # one of several prompts of token ids
                total += CHARS_PER_TOKEN * len(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                total += len(part["text"])
        return total
    return 0


def _load_json(body: bytes) -> Any:
    """The body's JSON document, as `json.loads` reads it.

    pydantic-core's parser is ~4x cheaper; what it refuses (a lone surrogate escape, a
    byte-order mark or UTF-16, nesting past its limit, and invalid JSON) is read again by
    `json.loads`, so what is accepted and each error's message stay `json`'s."""
    try:
        return from_json(body)
    except ValueError:
        pass
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None


def parse_body(body: bytes, kind: str, max_depth: int = 64) -> ParsedRequest:
    """`kind` is "chat", "completions", "embeddings" or one of OTHER_KINDS. Raises
    ApiError(400) on bad input, including arrays/objects nested deeper than `max_depth`."""
    if not body:
        raise ApiError(400, "request body is empty; expected a JSON object")
    document = _load_json(body)
    if not isinstance(document, dict):
        raise ApiError(400, "request body must be a JSON object")
    # Fewer brackets than the limit cannot nest deeper: skip the walk (C-speed count).
    if (body.count(b"[") + body.count(b"{") > max_depth
            and nesting_depth_exceeds(document, max_depth)):
        raise ApiError(400, f"request body nests arrays/objects deeper than {max_depth} levels")
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
            content = message.get("content")
            chars += len(content) if type(content) is str else _text_chars(content)
        prefix_keys = (prefix_keys_of([m.get("content") for m in messages])
                       if chars >= PREFIX_CHARS else ())
    elif kind == "completions":
        if "prompt" not in document:
            raise ApiError(400, "'prompt' is required", param="prompt")
        chars = _text_chars(document["prompt"])
        prefix_keys = prefix_keys_of([document["prompt"]]) if chars >= PREFIX_CHARS else ()
    elif kind == "embeddings":
        if "input" in document:
            chars = _text_chars(document["input"])
        elif isinstance(document.get("messages"), list):  # vLLM's chat-style embeddings
            chars = sum(_text_chars(message.get("content")) for message in document["messages"]
                        if isinstance(message, dict))
        else:
            raise ApiError(400, "'input' (or vLLM's 'messages') is required", param="input")
        prefix_keys = ()
    elif kind == "responses":
        return _parse_responses(document, model, stream)
    elif kind == "messages":
        return _parse_messages(document, model, stream)
    else:
        return _parse_other(document, kind, model)
    choices = _choices(document) if "n" in document else 1
    # `__new__` directly: half the cost of `ParsedRequest(...)` (see handlers' RouteRequest)
    return ParsedRequest.__new__(
        ParsedRequest, model=model, stream=stream, prompt_tokens=max(1, chars // CHARS_PER_TOKEN),
        completion_tokens=0 if kind == "embeddings" else _requested_tokens(document, choices),
        prefix_keys=prefix_keys, choices=choices)


def _parse_messages(document: dict[str, Any], model: str, stream: bool) -> ParsedRequest:
    """POST /v1/messages (Anthropic's Messages API, as vLLM serves it): `messages`, the
    `system` prompt and `max_tokens`, the little of it that routing needs."""
    messages = document.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' is required and must be a non-empty array",
                       param="messages")
    if not all(isinstance(message, dict) for message in messages):
        raise ApiError(400, "each message must be an object", param="messages")
    contents = [document.get("system"), *(message.get("content") for message in messages)]
    chars = sum(_text_chars(content) for content in contents)
    limit = lax_int(document.get("max_tokens"))
    return ParsedRequest(
        model=model, stream=stream, prompt_tokens=max(1, chars // CHARS_PER_TOKEN),
        completion_tokens=limit if limit is not None and limit >= 0 else None,
        prefix_keys=prefix_keys_of(contents) if chars >= PREFIX_CHARS else ())


# A response id as OpenAI and vLLM write them (`resp_` and hex or base62): what the router
# looks up in Redis, so never more than this.
_RESPONSE_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                               "0123456789_-")
MAX_RESPONSE_ID_CHARS = 128


def valid_response_id(value: str) -> bool:
    """Whether `value` can be a response id (letters, digits, '_' and '-'; at most 128)."""
    return 0 < len(value) <= MAX_RESPONSE_ID_CHARS and set(value) <= _RESPONSE_ID_CHARS


def _parse_responses(document: dict[str, Any], model: str, stream: bool) -> ParsedRequest:
    """POST /v1/responses: `input` (text or items), `instructions`, `max_output_tokens`,
    `store` and `previous_response_id`, the little of it that routing needs."""
    if "input" not in document:
        raise ApiError(400, "'input' is required", param="input")
    if "request_id" in document:
        # vLLM names the response by it: a client could take another's id (its record,
        # or the stored response itself on the same engine).
        raise ApiError(400, "'request_id' is not accepted: the engine names each response",
                       param="request_id")
    store = document.get("store", True)
    if not isinstance(store, bool):
        raise ApiError(400, "'store' must be true or false", param="store")
    previous = document.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str)
                                 or not valid_response_id(previous)):
        raise ApiError(400, "'previous_response_id' must be a response id ('resp_...')",
                       param="previous_response_id")
    instructions = document.get("instructions")
    items = document["input"] if isinstance(document["input"], list) else [document["input"]]
    # The text of the instructions, then of each input item (a message's content, text
    # parts): what the engine's prompt starts with, in its order.
    contents = [instructions if isinstance(instructions, str) else ""] + [
        item.get("content") if isinstance(item, dict) else item for item in items]
    chars = sum(_text_chars(content) for content in contents)
    limit = lax_int(document.get("max_output_tokens"))
    return ParsedRequest(
        model=model, stream=stream, prompt_tokens=max(1, chars // CHARS_PER_TOKEN),
        completion_tokens=limit if limit is not None and limit >= 0 else None,
        prefix_keys=prefix_keys_of(contents) if chars >= PREFIX_CHARS else (),
        previous_response_id=previous, store=store)


# Endpoints that name a model but generate nothing (vLLM's pooling, scoring and tokenizer
# endpoints): the path's kind, and the fields whose text makes up the prompt, any of which
# may be given (vLLM accepts several spellings: `text_1`/`text_2` or `queries`/`documents`
# for score, `input` or `messages` for pooling, `prompt` or `messages` for tokenize).
_PROMPT_FIELDS = {
    "rerank": ("query", "documents"),
    "score": ("text_1", "text_2", "queries", "documents", "data_1", "data_2"),
    "pooling": ("input", "messages"),
    "classify": ("input", "messages"),
    "tokenize": ("prompt", "messages"),
    "generative_scoring": ("query", "items"),
    "cohere_embed": ("texts", "inputs"),
    "count_tokens": ("system", "messages"),
    "batch_chat": ("messages",),
    "structured_decision": ("instructions", "state", "questions"),
}
_REQUIRED_FIELDS = {
    "rerank": (("query",), ("documents",)),
    "score": (("text_1", "queries", "data_1"), ("text_2", "documents", "data_2")),
    "pooling": (("input", "messages"),),
    "classify": (("input", "messages"),),
    "tokenize": (("prompt", "messages"),),
    "detokenize": (("tokens",),),
    "generative_scoring": (("query",), ("items",), ("label_token_ids",)),
    "cohere_embed": (("texts", "inputs", "images"),),
    "count_tokens": (("messages",),),
    "batch_chat": (("messages",),),
    "structured_decision": (("state",), ("questions",)),
}
# Kinds whose engine generates tokens (the rest only read the prompt).
_GENERATING = frozenset({"batch_chat", "structured_decision"})
OTHER_KINDS = frozenset(_REQUIRED_FIELDS)


def _content_chars(value: Any) -> int:
    """Characters of text in a field: a string, text parts, messages (their contents), or
    lists of these (a batch), (recursion bounded by the body's
    nesting, which parse_body checks first)."""
    if isinstance(value, list):
        total = 0
        for item in value:
            if isinstance(item, dict) and "role" in item:
                total += _content_chars(item.get("content"))
            elif isinstance(item, list):
                total += _content_chars(item)
            else:
                total += _text_chars([item])
        return total
    if isinstance(value, dict):  # e.g. a structured `state`
        return len(json.dumps(value, separators=(",", ":")))
    return _text_chars(value)


def _parse_other(document: dict[str, Any], kind: str, model: str) -> ParsedRequest:
    """A request to an endpoint of OTHER_KINDS: its model and prompt size; never streams,
    never generates. Raises ApiError(400) when a field the engine requires is missing."""
    for alternatives in _REQUIRED_FIELDS[kind]:
        if not any(name in document for name in alternatives):
            names = "' or '".join(alternatives)
            raise ApiError(400, f"'{names}' is required", param=alternatives[0])
    if kind == "detokenize":
        tokens = document["tokens"]
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise ApiError(400, "'tokens' must be an array of integers", param="tokens")
        prompt_tokens = max(1, len(tokens))
    else:
        chars = sum(_content_chars(document.get(name)) for name in _PROMPT_FIELDS[kind])
        prompt_tokens = max(1, chars // CHARS_PER_TOKEN)
    # A generating kind's output size is the engine's default unless the body names one.
    completion_tokens = (_requested_tokens(document, 1) if kind in _GENERATING else 0)
    return ParsedRequest(model=model, stream=False, prompt_tokens=prompt_tokens,
                         completion_tokens=completion_tokens)
