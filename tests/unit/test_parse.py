"""The request body parser: what it accepts is what `json.loads` accepts; errors are 400s."""

from __future__ import annotations

import json

import pytest

from router.core.errors import ApiError
from router.core.parse import PREFIX_CHARS, ParsedRequest, parse_body


def _chat(content: str, **extra: object) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": content}],
                       **extra}).encode()


def test_a_chat_request_gives_model_stream_and_sizes() -> None:
    parsed = parse_body(_chat("x" * 400, stream=True, max_tokens=30, n=2), "chat")
    assert parsed == ParsedRequest(model="m", stream=True, prompt_tokens=100,
                                   completion_tokens=60, prefix_key=None, choices=2)
    long = parse_body(_chat("y" * (PREFIX_CHARS + 5)), "chat")
    assert long.prefix_key is not None and long.completion_tokens is None
    assert parse_body(_chat("y" * (PREFIX_CHARS + 9)), "chat").prefix_key == long.prefix_key


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


def test_completions_and_embeddings_need_their_input() -> None:
    assert parse_body(b'{"model":"m","prompt":"abcdefgh"}', "completions").prompt_tokens == 2
    assert parse_body(b'{"model":"m","input":"abcd"}', "embeddings").completion_tokens == 0
    for body, kind in ((b'{"model":"m"}', "completions"), (b'{"model":"m"}', "embeddings")):
        with pytest.raises(ApiError):
            parse_body(body, kind)
