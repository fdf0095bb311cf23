"""The request body parser: what it accepts is what `json.loads` accepts; errors are 400s."""

from __future__ import annotations

import json

import pytest

from router.core.errors import ApiError
from router.core.parse import PREFIX_CHARS, PREFIX_LEVELS, ParsedRequest, parse_body


def _chat(content: str, **extra: object) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": content}],
                       **extra}).encode()


def test_a_chat_request_gives_model_stream_and_sizes() -> None:
    parsed = parse_body(_chat("x" * 400, stream=True, max_tokens=30, n=2), "chat")
    assert parsed == ParsedRequest(model="m", stream=True, prompt_tokens=100,
                                   completion_tokens=60, prefix_keys=(), choices=2)
    long = parse_body(_chat("y" * (PREFIX_CHARS + 5)), "chat")
    assert len(long.prefix_keys) == 1 and long.completion_tokens is None
    assert parse_body(_chat("y" * (PREFIX_CHARS + 9)), "chat").prefix_keys == long.prefix_keys


def test_prefix_keys_cover_doubling_lengths_and_part_where_prompts_part() -> None:
    shared = "s" * 5000  # a system prompt: levels of 1k, 2k and 4k characters fit in it

    def keys(*contents: str, kind: str = "chat") -> tuple[int, ...]:
        if kind == "completions":
            body = json.dumps({"model": "m", "prompt": "".join(contents)}).encode()
            return parse_body(body, kind).prefix_keys
        messages = [{"role": "system", "content": contents[0]},
                    *({"role": "user", "content": c} for c in contents[1:])]
        return parse_body(json.dumps({"model": "m", "messages": messages}).encode(),
                          "chat").prefix_keys

    one, other = keys(shared, "a" * 4000), keys(shared, "b" * 4000)
    assert len(one) == len(other) == 4  # 9,001 characters: 1k, 2k, 4k and 8k
    assert one[:3] == other[:3] and one[3] != other[3]
    # a change at character 1,500 parts the keys from the 2k one on
    edited = keys(shared[:1500] + "x" + shared[1501:], "a" * 4000)
    assert edited[0] == one[0] and edited[1] != one[1]
    # content parts and non-ASCII text (keys are of UTF-8 bytes)
    parts = parse_body(json.dumps({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "\u00fc" * 1500}]}]}).encode(), "chat").prefix_keys
    assert len(parts) == 2  # 3,000 bytes
    # at most PREFIX_LEVELS keys, however long the prompt
    assert len(keys("z" * (PREFIX_CHARS << PREFIX_LEVELS), kind="completions")) == PREFIX_LEVELS


@pytest.mark.parametrize("body", [
    b'{"model":"m","messages":[{"role":"user","content":"\\ud800 cut emoji"}]}',  # lone surrogate
    b'\xef\xbb\xbf{"model":"m","messages":[{"role":"user","content":"bom"}]}',  # UTF-8 BOM
    '{"model":"m","messages":[{"role":"user","content":"\u00fc"}]}'.encode("utf-16"),
    b'{"model":"m","messages":[{"role":"user","content":"x"}],"temperature":NaN}',
])
def test_bodies_json_loads_accepts_are_accepted(body: bytes) -> None:
    assert parse_body(body, "chat").model == "m"


def test_nesting_is_refused_past_the_limit_at_any_depth() -> None:
    def nested(depth: int) -> bytes:
        return (b'{"model":"m","messages":[{"role":"user","content":"x"}],"extra":'
                + b"[" * depth + b"]" * depth + b"}")

    assert parse_body(nested(60), "chat", max_depth=64).model == "m"
    # 500: past the fast parser's own limit, within json's; 5000: past json's too.
    for depth, says in ((70, "deeper than 64 levels"), (500, "deeper than 64 levels"),
                        (5000, "not valid JSON: maximum recursion depth exceeded")):
        with pytest.raises(ApiError) as caught:
            parse_body(nested(depth), "chat", max_depth=64)
        assert caught.value.status == 400
        assert says in caught.value.message


@pytest.mark.parametrize(("body", "says"), [
    (b"", "request body is empty"),
    (b"{not json", "request body is not valid JSON: Expecting property name"),
    (b'{"model":"m"} trailing', "request body is not valid JSON: Extra data"),
    (b'{"model":"\x00"}', "request body is not valid JSON: Invalid control character"),
    (b"[1, 2]", "must be a JSON object"),
    (b'{"messages":[{"role":"user","content":"x"}]}', "'model' is required"),
    (b'{"model":"m","stream":"yes","messages":[{"role":"user","content":"x"}]}',
     "'stream' must be true or false"),
    (b'{"model":"m","messages":[]}', "'messages' is required"),
    (b'{"model":"m","messages":["hi"]}', "each message must be an object"),
])
def test_bad_bodies_get_a_400_that_says_why(body: bytes, says: str) -> None:
    with pytest.raises(ApiError) as caught:
        parse_body(body, "chat")
    assert caught.value.status == 400
    assert says in caught.value.message


def test_chat_style_embeddings_name_messages_instead_of_input() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 40}, "not a message"]}
    assert parse_body(json.dumps(body).encode(), "embeddings").prompt_tokens == 10


def test_completions_and_embeddings_need_their_input() -> None:
    assert parse_body(b'{"model":"m","prompt":"abcdefgh"}', "completions").prompt_tokens == 2
    assert parse_body(b'{"model":"m","input":"abcd"}', "embeddings").completion_tokens == 0
    for body, kind in ((b'{"model":"m"}', "completions"), (b'{"model":"m"}', "embeddings")):
        with pytest.raises(ApiError):
            parse_body(body, kind)
