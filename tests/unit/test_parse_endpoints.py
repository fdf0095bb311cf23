"""vLLM's endpoints beyond chat, completions and embeddings: every one of the real
server's that names a model is routed by it, and its body parsed for model and size."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.core.endpoints import KIND_BY_PATH
from router.core.errors import ApiError
from router.core.parse import OTHER_KINDS, parse_body

ROOT = Path(__file__).resolve().parents[2]
ENDPOINTS = json.loads((ROOT / "tests" / "fixtures" / "vllm-0.32-cpu-endpoints.json").read_text())
SHAPES = json.loads((ROOT / "tests" / "fixtures" / "vllm-0.32-cpu-shapes.json").read_text())

# Model-naming JSON endpoints of the fixture the router does not route, and why.
NOT_ROUTED: dict[str, str] = {}


def _model_paths() -> set[str]:
    return {e["path"] for e in ENDPOINTS["endpoints"]
            if e["takes_model"] and e["content_type"] == "application/json"}


def test_every_model_naming_json_endpoint_of_real_vllm_is_routed() -> None:
    missing = _model_paths() - set(KIND_BY_PATH) - set(NOT_ROUTED)
    assert not missing, f"vLLM endpoints that name a model but are not routed: {missing}"
    assert set(NOT_ROUTED) <= _model_paths()  # a reason for something vLLM does not have is stale



def test_every_path_about_a_stored_response_is_routed_with_its_method() -> None:
    from router.app import RouterSettings, build_app
    from router.config_loader import parse_config
    config = parse_config({"apiVersion": "globalpool/v1", "regions": {"r": {"models": ["m"]}}})
    app = build_app(RouterSettings(config=config, redis_url="redis://127.0.0.1:1/0",
                                   region="r", heartbeat_keys={}))
    routes = {(route.method, route.resource.canonical) for route in app.router.routes()
              if route.resource is not None}
    stateful = {(e["method"], e["path"]) for e in ENDPOINTS["endpoints"]
                if "{response_id}" in e["path"]}
    assert stateful and stateful <= routes


def test_the_real_servers_requests_parse_as_it_judged_them() -> None:
    """What vLLM refused with a 400 the router refuses too; the rest parse to their model."""
    for runner in ("generate_runner", "pooling_runner"):
        for case in SHAPES[runner]:
            body, kind = json.dumps(case["request"]).encode(), KIND_BY_PATH[case["path"]]
            if case["status"] == 400:
                with pytest.raises(ApiError):
                    parse_body(body, kind)
                continue
            parsed = parse_body(body, kind)
            assert parsed.model == case["request"]["model"]
            assert parsed.prompt_tokens >= 1


@pytest.mark.parametrize(("kind", "body", "tokens"), [
    ("rerank", {"query": "q" * 40, "documents": ["d" * 40, {"text": "e" * 40}]}, 30),
    ("score", {"text_1": "a" * 40, "text_2": ["b" * 40, "c" * 40]}, 30),
    ("score", {"queries": "a" * 40, "documents": "b" * 40}, 20),
    ("pooling", {"input": ["x" * 80]}, 20),
    ("classify", {"messages": [{"role": "user", "content": "x" * 80}]}, 20),
    ("tokenize", {"prompt": "x" * 400}, 100),
    ("detokenize", {"tokens": [1, 2, 3]}, 3),
    ("batch_chat", {"messages": [[{"role": "user", "content": "x" * 40}]] * 2}, 20),
    ("cohere_embed", {"texts": ["x" * 40]}, 10),
])
def test_prompt_size_is_estimated_per_kind(kind: str, body: dict[str, Any], tokens: int) -> None:
    parsed = parse_body(json.dumps({"model": "m", "extra": {"kept": 1}, **body}).encode(), kind)
    assert (parsed.model, parsed.stream, parsed.prompt_tokens) == ("m", False, tokens)
    assert parsed.completion_tokens == (None if kind == "batch_chat" else 0)


@pytest.mark.parametrize(("kind", "body", "param"), [
    ("rerank", {"documents": ["a"]}, "query"),
    ("score", {"text_1": "a"}, "text_2"),
    ("pooling", {}, "input"),
    ("tokenize", {}, "prompt"),
    ("detokenize", {"tokens": ["a"]}, "tokens"),
    ("detokenize", {"tokens": 3}, "tokens"),
])
def test_a_body_the_engine_would_refuse_is_a_400(kind: str, body: dict[str, Any],
                                                 param: str) -> None:
    with pytest.raises(ApiError) as raised:
        parse_body(json.dumps({"model": "m", **body}).encode(), kind)
    assert (raised.value.status, raised.value.param) == (400, param)


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                     lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=20)
_FIELDS = st.sampled_from(["model", "query", "documents", "text_1", "text_2", "queries",
                           "input", "messages", "prompt", "tokens", "items", "texts",
                           "label_token_ids", "state", "questions", "role", "content"])


@given(kind=st.sampled_from(sorted(OTHER_KINDS)),
       body=st.dictionaries(_FIELDS, _JSON, max_size=6) | _JSON)
def test_any_json_is_parsed_or_refused_with_a_400(kind: str, body: Any) -> None:
    try:
        parsed = parse_body(json.dumps(body).encode(), kind)
    except ApiError as exc:
        assert exc.status == 400
    else:
        assert parsed.model == body["model"] and parsed.prompt_tokens >= 1


def test_an_anthropic_messages_request_is_parsed_for_routing() -> None:
    parsed = parse_body(json.dumps({
        "model": "m", "max_tokens": 32, "stream": True, "system": "s" * 40,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "x" * 80}]}],
    }).encode(), "messages")
    assert (parsed.model, parsed.stream, parsed.completion_tokens, parsed.prompt_tokens) == (
        "m", True, 32, 30)
    for body in (b'{"model": "m", "messages": []}', b'{"model": "m", "messages": ["hi"]}',
                 b'{"model": "m", "max_tokens": 1}'):
        with pytest.raises(ApiError) as refused:
            parse_body(body, "messages")
        assert refused.value.param == "messages"
