"""vLLM's endpoints beyond chat through the router: routed by model to real simulators
(a real Valkey, the real router app), with the unchanged `openai` client where it has a
call for them."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.test_proxy import Fleet, FleetFactory, fleet_factory

pytestmark = pytest.mark.integration
__all__ = ["fleet_factory"]  # the fixture, used by name

WORKERS = {"a": "us-east", "b": "eu-west"}


async def _post(fleet: Fleet, path: str, body: dict[str, Any] | bytes) -> tuple[int, Any, str]:
    kwargs: dict[str, Any] = ({"data": body, "headers": {"Content-Type": "application/json"}}
                              if isinstance(body, bytes) else {"json": body})
    async with aiohttp.ClientSession() as session, session.post(
            fleet.router_url + path, **kwargs) as response:
        # the router's own front answered (router.proxy.front), not aiohttp's server
        assert response.headers.get("Server") == "globalpool", path
        return (response.status, await response.json(content_type=None),
                response.headers.get("x-globalpool-worker", ""))


@pytest.mark.parametrize(("path", "body", "key"), [
    ("/v1/rerank", {"query": "q", "documents": ["a", "b"], "top_n": 1}, "results"),
    ("/rerank", {"query": "q", "documents": ["a"]}, "results"),
    ("/v2/rerank", {"query": "q", "documents": ["a"]}, "results"),
    ("/v1/score", {"text_1": "a", "text_2": ["b", "c"]}, "data"),
    ("/score", {"queries": "a", "documents": "b"}, "data"),
    ("/pooling", {"input": "hi"}, "data"),
    ("/tokenize", {"prompt": "hello world"}, "tokens"),
    ("/detokenize", {"tokens": [1, 2, 3]}, "prompt"),
])
async def test_each_endpoint_is_routed_to_a_worker_of_its_model(
        fleet_factory: FleetFactory, path: str, body: dict[str, Any], key: str) -> None:
    fleet = await fleet_factory(WORKERS)
    status, answer, worker = await _post(fleet, path, {"model": "m", "unknown": [1], **body})
    assert status == 200, answer
    assert key in answer and worker in WORKERS
    if path == "/v1/rerank":
        assert len(answer["results"]) == 1  # top_n reached the engine unchanged


async def test_the_openai_client_embeds_and_retrieves_models(
        fleet_factory: FleetFactory) -> None:
    fleet = await fleet_factory(WORKERS)
    async with AsyncOpenAI(base_url=fleet.router_url + "/v1", api_key="unused",
                           max_retries=0) as client:
        first = await client.embeddings.create(model="m", input=["hello", "world"])
        again = await client.embeddings.create(model="m", input="hello")
        card = await client.models.retrieve("m")
        with pytest.raises(openai.NotFoundError) as missing:
            await client.models.retrieve("org/no-such-model")
    assert len(first.data) == 2 and len(first.data[0].embedding) == 128
    assert again.data[0].embedding == first.data[0].embedding
    assert (card.id, card.object, card.owned_by) == ("m", "model", "globalpool")
    assert isinstance(card.created, int)
    error = missing.value.body
    assert isinstance(error, dict) and error["code"] == "model_not_found"


async def test_a_model_id_with_a_slash_is_found(fleet_factory: FleetFactory) -> None:
    fleet = await fleet_factory(WORKERS)
    async with aiohttp.ClientSession() as session:
        async with session.get(fleet.router_url + "/v1/models/org/m") as response:
            assert response.status == 404  # the path's id is "org/m", not "m"
            assert (await response.json())["error"]["code"] == "model_not_found"
        async with session.get(fleet.router_url + "/v1/models/m") as response:
            assert (await response.json())["id"] == "m"


async def test_an_unknown_model_is_an_openai_404(fleet_factory: FleetFactory) -> None:
    fleet = await fleet_factory(WORKERS)
    for path, body in (("/v1/rerank", {"query": "q", "documents": ["a"]}),
                       ("/tokenize", {"prompt": "hi"})):
        status, answer, _ = await _post(fleet, path, {"model": "org/other", **body})
        assert status == 404
        assert answer["error"]["code"] == "model_not_found"
        assert answer["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/rerank", b'{"model": "m", "query": "q"', None),  # not JSON
    ("/v1/rerank", json.dumps({"model": "m", "query": "q"}).encode(), "documents"),
    ("/detokenize", json.dumps({"model": "m", "tokens": "abc"}).encode(), "tokens"),
    ("/v1/score", json.dumps({"text_1": "a", "text_2": "b"}).encode(), "model"),
])
async def test_a_malformed_body_is_an_openai_400(fleet_factory: FleetFactory, path: str,
                                                 body: bytes, param: str | None) -> None:
    fleet = await fleet_factory(WORKERS)
    status, answer, worker = await _post(fleet, path, body)
    assert (status, worker) == (400, "")
    assert answer["error"]["type"] == "invalid_request_error"
    assert answer["error"]["param"] == param


async def test_requests_are_counted_in_metrics_by_kind(fleet_factory: FleetFactory) -> None:
    fleet = await fleet_factory(WORKERS)
    for _ in range(2):
        assert (await _post(fleet, "/v1/rerank", {"model": "m", "query": "q",
                                                  "documents": ["a"]}))[0] == 200
    assert (await _post(fleet, "/tokenize", {"model": "m", "prompt": "hi"}))[0] == 200
    async with aiohttp.ClientSession() as session, session.get(
            fleet.router_url + "/metrics") as response:
        text = await response.text()
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "globalpool_requests_total" and sample.labels["status"] == "200":
                kind = sample.labels["kind"]
                counts[kind] = counts.get(kind, 0) + sample.value
    assert counts == {"rerank": 2, "tokenize": 1}


async def test_n_choices_pass_through_the_router_whole_and_streamed(
        fleet_factory: FleetFactory) -> None:
    fleet = await fleet_factory(WORKERS)
    async with AsyncOpenAI(base_url=fleet.router_url + "/v1", api_key="unused",
                           max_retries=0) as client:
        whole = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Hi"}], n=2, max_tokens=3)
        stream = await client.completions.create(model="m", prompt="Hi", n=2, max_tokens=3,
                                                 stream=True)
        indexes = {choice.index async for chunk in stream for choice in chunk.choices}
    assert [choice.index for choice in whole.choices] == [0, 1]
    assert indexes == {0, 1}


async def test_the_openai_client_transcribes_and_translates_through_the_router(
        fleet_factory: FleetFactory) -> None:
    fleet = await fleet_factory(WORKERS)
    audio = b"RIFF" + bytes(range(256)) * 64  # binary, with CR LF and dashes inside
    async with AsyncOpenAI(base_url=fleet.router_url + "/v1", api_key="unused",
                           max_retries=0) as client:
        heard = await client.audio.transcriptions.with_raw_response.create(
            model="m", file=("a.wav", audio, "audio/wav"), language="en")
        said = await client.audio.translations.create(model="m", file=("a.wav", audio))
        with pytest.raises(openai.NotFoundError):
            await client.audio.transcriptions.create(model="nobody", file=("a.wav", audio))
    assert heard.headers["x-globalpool-worker"] in WORKERS
    assert heard.parse().text and said.text
    async with aiohttp.ClientSession() as session:
        form = aiohttp.FormData()
        form.add_field("file", audio, filename="a.wav")
        async with session.post(fleet.router_url + "/v1/audio/transcriptions",
                                data=form) as response:
            assert response.status == 400  # no model field: nothing to route by
            assert (await response.json())["error"]["param"] == "model"
