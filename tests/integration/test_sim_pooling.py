"""The simulator's embeddings, pooling, rerank, score, tokenize and detokenize, in the
shapes the real vLLM 0.32 answered (tests/fixtures/vllm-0.32-cpu-shapes.json)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI

from lab.sim.server import SimServer

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SHAPES = json.loads((ROOT / "tests" / "fixtures" / "vllm-0.32-cpu-shapes.json").read_text())
REAL = {(case["path"], json.dumps(case["request"], sort_keys=True)): case
        for runner in ("generate_runner", "pooling_runner") for case in SHAPES[runner]}


def _shape(value: Any) -> Any:
    """Keys and value types, recursively (lists by their first item)."""
    if isinstance(value, dict):
        return {key: _shape(item) for key, item in value.items() if not key.endswith("_length")}
    if isinstance(value, list):
        return [_shape(value[0])] if value else []
    return "number" if isinstance(value, int | float) and not isinstance(value, bool) else (
        type(value).__name__)


@pytest.mark.parametrize("key", [key for key in REAL if REAL[key]["status"] == 200
                                 and not key[0].startswith("/v1/c")])  # chat: test_sim_api
async def test_each_answer_has_the_real_servers_shape(sim: SimServer,
                                                      http: aiohttp.ClientSession,
                                                      key: tuple[str, str]) -> None:
    case = REAL[key]
    async with http.post(sim.url + case["path"], json=case["request"]) as response:
        assert response.status == 200, await response.text()
        assert _shape(await response.json()) == _shape(case["response"])


async def test_embeddings_are_deterministic_unit_vectors_through_the_openai_client(
        sim: SimServer) -> None:
    async with AsyncOpenAI(base_url=sim.url + "/v1", api_key="unused", max_retries=0) as client:
        first = await client.embeddings.create(model="tiny-llama", input=["hello", "other"])
        again = await client.embeddings.create(model="tiny-llama", input="hello")
        floats = await client.embeddings.create(model="tiny-llama", input="hello",
                                                encoding_format="float")
    vector = first.data[0].embedding
    assert len(vector) == 128 and math.isclose(math.fsum(x * x for x in vector), 1.0, rel_tol=1e-6)
    assert again.data[0].embedding == vector  # base64 (the client's default) round trip
    assert floats.data[0].embedding == pytest.approx(vector, rel=1e-6)
    assert first.data[1].embedding != vector
    assert first.usage.prompt_tokens == 4


async def test_rerank_sorts_by_relevance_and_keeps_top_n(sim: SimServer,
                                                         http: aiohttp.ClientSession) -> None:
    body = {"model": "tiny-llama", "query": "q", "documents": ["a", "b", "c"], "top_n": 2}
    async with http.post(sim.url + "/v1/rerank", json=body) as response:
        results = (await response.json())["results"]
    assert len(results) == 2
    assert results[0]["relevance_score"] >= results[1]["relevance_score"]
    # As vLLM's pydantic `int` takes it: 2.0 is 2; a fraction is no integer (a 400, which
    # the router passes on: schemathesis found the sim answering 200 to top_n: -2.8e-136).
    async with http.post(sim.url + "/v1/rerank", json={**body, "top_n": 2.0}) as response:
        assert len((await response.json())["results"]) == 2


@pytest.mark.parametrize(("path", "body", "status"), [
    ("/tokenize", {"model": "no-such", "prompt": "hi"}, 404),
    ("/v1/embeddings", {"model": "no-such", "input": "hi"}, 404),
    ("/detokenize", {"model": "tiny-llama"}, 400),
    ("/v1/score", {"model": "tiny-llama", "text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, 400),
    ("/v1/rerank", {"model": "tiny-llama", "query": 3, "documents": ["a"]}, 400),
    ("/v1/rerank", {"model": "tiny-llama", "query": "q", "documents": ["a"], "top_n": 0.5},
     400),
    ("/v1/rerank", {"model": "tiny-llama", "query": "q", "documents": ["a"], "top_n": True},
     400),
])
async def test_errors_are_vllm_format(sim: SimServer, http: aiohttp.ClientSession, path: str,
                                      body: dict[str, Any], status: int) -> None:
    async with http.post(sim.url + path, json=body) as response:
        assert response.status == status
        error = (await response.json())["error"]
    assert error["code"] == status and isinstance(error["message"], str)


async def test_an_unknown_path_is_a_json_404(sim: SimServer, http: aiohttp.ClientSession) -> None:
    async with http.post(sim.url + "/classify", json={"model": "tiny-llama"}) as response:
        assert (response.status, await response.json()) == (404, {"detail": "Not Found"})
