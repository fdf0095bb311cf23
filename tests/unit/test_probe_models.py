"""/v1/models and /version answers, shaped as vLLM sends them."""

from __future__ import annotations

from typing import Any

import pytest

from worker.probe import EngineVersion, ServedModels, parse_models, parse_version


def vllm_model(model_id: str, root: str, parent: str | None) -> dict[str, Any]:
    return {
        "id": model_id, "object": "model", "created": 1795965602, "owned_by": "vllm",
        "root": root, "parent": parent, "max_model_len": 2048,
        "permission": [{"id": "modelperm-1", "object": "model_permission"}],
    }


def test_base_models_and_lora_adapters_are_split_by_parent() -> None:
    payload = {"object": "list", "data": [
        # --served-model-name makes a base model's root differ from its id.
        vllm_model("tiny-llama", "/models/TinyLlama-1.1B-Chat", None),
        vllm_model("sql-lora", "/adapters/sql", "tiny-llama"),
        vllm_model("chat-lora", "/adapters/chat", "tiny-llama"),
    ]}
    assert parse_models(payload) == ServedModels(("tiny-llama",), ("sql-lora", "chat-lora"),
                                                 max_model_len=2048)


def test_openai_style_entries_without_parent_are_models() -> None:
    payload = {"data": [{"id": "gpt-x", "object": "model"}]}
    assert parse_models(payload) == ServedModels(("gpt-x",), ())


@pytest.mark.parametrize("payload", [[], {"data": "x"}, {"data": [{"object": "model"}]}, None])
def test_unexpected_shapes_are_value_errors(payload: Any) -> None:
    with pytest.raises(ValueError):
        parse_models(payload)


def test_version() -> None:
    assert parse_version({"version": "0.32.0"}) == EngineVersion("0.32.0", simulator=False)
    assert parse_version({"version": "0.1.0", "simulator": True}).simulator
    with pytest.raises(ValueError):
        parse_version({"version": 32})
