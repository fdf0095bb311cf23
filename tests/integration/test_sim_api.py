"""The simulator's OpenAI API on loopback, through the `openai` client and raw HTTP."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from lab.sim.server import SimServer
from tests.conftest import FIXTURES
from tests.integration.conftest import StartSim

pytestmark = pytest.mark.integration



@pytest.fixture
async def sim(start_sim: StartSim) -> SimServer:
    return await start_sim()


@pytest.fixture
async def client(sim: SimServer) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(base_url=sim.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(http: aiohttp.ClientSession, sim: SimServer) -> Samples:
    async with http.get(sim.url + "/metrics") as response:
        text = await response.text()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def engine_sample(samples: Samples, name: str, **labels: str) -> float:
    """A sample labelled engine="0", model_name="tiny-llama" plus `labels`."""
    key = frozenset({"engine": "0", "model_name": "tiny-llama", **labels}.items())
    return samples[(name, key)]


async def test_chat_completion(client: AsyncOpenAI) -> None:
    reply = await client.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "Hello, sim!"}], max_tokens=7
    )
    assert reply.id.startswith("chatcmpl-")
    assert reply.object == "chat.completion"
    assert reply.model == "tiny-llama"
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.role == "assistant"
    assert choice.message.content and len(choice.message.content.split()) == 7
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (3, 7)
    assert reply.usage.total_tokens == 10


async def test_chat_stream_with_usage(client: AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_completion_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    first, *tokens, last_token, usage_chunk = chunks
    assert first.choices[0].delta.role == "assistant"
    assert first.choices[0].delta.content == ""
    assert len(tokens) + 1 == 5
    assert all(c.choices[0].finish_reason is None for c in tokens)
    assert last_token.choices[0].finish_reason == "length"
    assert usage_chunk.choices == []
    assert usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == 5
    assert usage_chunk.usage.total_tokens == usage_chunk.usage.prompt_tokens + 5


async def test_chat_stream_without_usage_has_no_usage_chunk(client: AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "Hi"}], max_tokens=3, stream=True
    )
    chunks = [chunk async for chunk in stream]
    assert len(chunks) == 4  # role + 3 tokens
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)


async def test_completion_and_stream(client: AsyncOpenAI) -> None:
    reply = await client.completions.create(model="tiny-llama", prompt="Once upon", max_tokens=4)
    assert reply.id.startswith("cmpl-") and reply.object == "text_completion"
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 4

    stream = await client.completions.create(
        model="tiny-llama",
        prompt="Once upon",
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    *tokens, usage_chunk = chunks
    assert "".join(c.choices[0].text for c in tokens) == reply.choices[0].text  # same seed
    assert [c.choices[0].finish_reason for c in tokens] == [None, None, None, "length"]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == 4


async def test_completion_accepts_token_ids(client: AsyncOpenAI) -> None:
    reply = await client.completions.create(
        model="tiny-llama", prompt=[1, 2, 3, 4, 5], max_tokens=2
    )
    assert reply.usage is not None and reply.usage.prompt_tokens == 5


async def test_eos_gives_finish_reason_stop(start_sim: StartSim) -> None:
    sim = await start_sim(eos_probability=1.0)
    async with AsyncOpenAI(base_url=sim.url + "/v1", api_key="x", max_retries=0) as client:
        reply = await client.chat.completions.create(
            model="tiny-llama", messages=[{"role": "user", "content": "Hi"}], max_tokens=10
        )
        assert reply.choices[0].finish_reason == "stop"
        ignored = await client.chat.completions.create(
            model="tiny-llama",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=10,
            extra_body={"ignore_eos": True},
        )
        assert ignored.choices[0].finish_reason == "length"


async def test_sse_framing_and_headers(sim: SimServer, http: aiohttp.ClientSession) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True}
    async with http.post(sim.url + "/v1/chat/completions", json=body) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        raw = await response.read()
    events = raw.decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert [p["choices"][0]["delta"] for p in payloads] == [
        {"role": "assistant", "content": ""},
        {"content": payloads[1]["choices"][0]["delta"]["content"]},
        {"content": payloads[2]["choices"][0]["delta"]["content"]},
    ]


async def test_stream_tokens_arrive_one_by_one(start_sim: StartSim) -> None:
    sim = await start_sim(decode_step_ms=30.0)
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
    arrivals: list[float] = []
    loop = asyncio.get_running_loop()
    async with (
        aiohttp.ClientSession() as http,
        http.post(sim.url + "/v1/chat/completions", json=body) as response,
    ):
        async for _ in response.content.iter_any():
            arrivals.append(loop.time())
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert len(arrivals) >= 4
    assert sum(1 for gap in gaps if gap > 0.015) >= 3  # one write per decode step


async def test_error_format_for_malformed_json(sim: SimServer, http: aiohttp.ClientSession) -> None:
    async with http.post(sim.url + "/v1/chat/completions", data=b"{not json") as response:
        assert response.status == 400
        body = await response.json()
    assert set(body) == {"error"}
    assert body["error"]["type"] == "BadRequestError"
    assert body["error"]["code"] == 400
    assert body["error"]["param"] is None
    assert "JSON" in body["error"]["message"]


async def test_missing_messages_and_prompt_are_400(client: AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as chat_error:
        await client.chat.completions.create(model="tiny-llama", messages=[])
    assert chat_error.value.status_code == 400
    with pytest.raises(openai.BadRequestError, match="prompt"):
        await client.post("/completions", body={"model": "tiny-llama"}, cast_to=object)


async def test_unknown_model_is_404(client: AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as error:
        await client.chat.completions.create(
            model="gpt-9", messages=[{"role": "user", "content": "Hi"}]
        )
    assert error.value.body == {
        "message": "The model `gpt-9` does not exist.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }


async def test_n_above_one_gives_n_choices_whole_and_streamed(client: AsyncOpenAI) -> None:
    messages: Any = [{"role": "user", "content": "Hi"}]
    chat = await client.chat.completions.create(model="tiny-llama", messages=messages, n=3,
                                                max_tokens=4)
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert len({c.message.content for c in chat.choices}) > 1  # the choices differ
    assert chat.usage is not None and chat.usage.completion_tokens == 12
    text = await client.completions.create(model="tiny-llama", prompt="Hi", n=2, max_tokens=3)
    assert [c.index for c in text.choices] == [0, 1]
    pieces: dict[int, list[str]] = {}
    reasons: dict[int, str | None] = {}
    stream = await client.chat.completions.create(
        model="tiny-llama", messages=messages, n=2, max_tokens=4, stream=True,
        stream_options={"include_usage": True})
    usage_tokens = 0
    async for chunk in stream:
        if chunk.usage is not None:
            usage_tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            pieces.setdefault(choice.index, []).append(choice.delta.content or "")
            reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
    assert sorted(pieces) == [0, 1] and reasons == {0: "length", 1: "length"}
    assert usage_tokens == 8


async def test_n_above_the_bound_and_overlong_requests_are_400(client: AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="n must be at most 128"):
        await client.chat.completions.create(
            model="tiny-llama", messages=[{"role": "user", "content": "Hi"}], n=2**40
        )
    with pytest.raises(openai.BadRequestError, match="greater than max_model_len=4096"):
        await client.chat.completions.create(
            model="tiny-llama", messages=[{"role": "user", "content": "Hi"}], max_tokens=5000
        )


async def test_models_health_version(
    sim: SimServer, client: AsyncOpenAI, http: aiohttp.ClientSession
) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == ["tiny-llama"]
    card = models.data[0].model_dump()
    assert card["owned_by"] == "vllm" and card["max_model_len"] == 4096
    async with http.get(sim.url + "/health") as response:
        assert response.status == 200
        assert await response.read() == b""
    async with http.get(sim.url + "/version") as response:
        version = await response.json()
    assert version["simulator"] is True and version["version"].startswith("sim-")


async def test_full_queue_answers_503(start_sim: StartSim) -> None:
    sim = await start_sim(max_num_seqs=1, max_num_queued_reqs=1, decode_step_ms=20.0)
    async with AsyncOpenAI(base_url=sim.url + "/v1", api_key="x", max_retries=0) as client:
        messages: Any = [{"role": "user", "content": "Hi"}]
        running = await client.chat.completions.create(
            model="tiny-llama", messages=messages, max_tokens=30, stream=True
        )
        await running.__anext__()  # admitted: the role chunk came with its first token
        waiting = asyncio.create_task(
            client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=1)
        )
        await asyncio.sleep(0.05)
        with pytest.raises(openai.InternalServerError) as error:
            await client.chat.completions.create(model="tiny-llama", messages=messages)
        assert error.value.status_code == 503
        assert "Retry-After" not in error.value.response.headers
        assert isinstance(error.value.body, dict)
        assert error.value.body["type"] == "ServiceUnavailableError"
        await running.close()
        assert (await waiting).choices[0].finish_reason == "length"


async def test_client_disconnect_aborts_the_sequence(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(decode_step_ms=20.0)
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 500, "stream": True}
    async with http.post(sim.url + "/v1/chat/completions", json=body) as response:
        await response.content.readline()
        assert engine_sample(await scrape(http, sim), "vllm:num_requests_running") == 1.0
    # Leaving the block without reading to the end closes the connection.
    for _ in range(100):
        samples = await scrape(http, sim)
        if engine_sample(samples, "vllm:request_success_total", finished_reason="abort") == 1.0:
            break
        await asyncio.sleep(0.02)
    assert engine_sample(samples, "vllm:request_success_total", finished_reason="abort") == 1.0
    assert engine_sample(samples, "vllm:num_requests_running") == 0.0
    assert engine_sample(samples, "vllm:kv_cache_usage_perc") == 0.0


async def test_metrics_count_the_traffic(
    sim: SimServer, client: AsyncOpenAI, http: aiohttp.ClientSession
) -> None:
    prompt = "A shared system prompt, 32 chars" * 25  # 800 chars = 200 tokens
    for _ in range(2):
        await client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=3)
    samples = await scrape(http, sim)
    assert engine_sample(samples, "vllm:prompt_tokens_total") == 400
    assert engine_sample(samples, "vllm:generation_tokens_total") == 6
    assert engine_sample(samples, "vllm:request_success_total", finished_reason="length") == 2
    assert engine_sample(samples, "vllm:prefix_cache_queries_total") == 400
    assert engine_sample(samples, "vllm:prefix_cache_hits_total") == 192  # 12 blocks of 16
    assert engine_sample(samples, "vllm:time_to_first_token_seconds_count") == 2
    assert engine_sample(samples, "vllm:e2e_request_latency_seconds_count") == 2
    assert engine_sample(samples, "vllm:inter_token_latency_seconds_count") == 4


def families_with_labels(text: str) -> dict[str, set[frozenset[str]]]:
    """Family name -> the label-name sets of its samples (bucket `le` left out)."""
    found: dict[str, set[frozenset[str]]] = {}
    for family in text_string_to_metric_families(text):
        label_sets = found.setdefault(family.name, set())
        for sample in family.samples:
            label_sets.add(frozenset(sample.labels) - {"le"})
    return found


async def test_metric_names_and_labels_match_vllm_0_32(
    sim: SimServer, client: AsyncOpenAI, http: aiohttp.ClientSession
) -> None:
    await client.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "Hi"}], max_tokens=3
    )
    async with http.get(sim.url + "/metrics") as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        ours = families_with_labels(await response.text())
    real = families_with_labels((FIXTURES / "vllm-0.32-cpu-metrics.txt").read_text())

    for name, label_sets in ours.items():
        assert name in real, f"{name} is not a vLLM 0.32 metric"
        assert label_sets == real[name], f"{name}: labels differ from vLLM 0.32"
    required = {
        "vllm:num_requests_running", "vllm:num_requests_waiting",
        "vllm:num_requests_waiting_by_reason", "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:prompt_tokens",
        "vllm:generation_tokens", "vllm:request_success", "vllm:num_preemptions",
        "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
        "vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:cache_config_info",
    }  # fmt: skip
    assert required <= set(ours)


async def test_legacy_metrics_rename_kv_usage(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(legacy_metrics=True)
    names = {name for name, _ in await scrape(http, sim)}
    assert "vllm:gpu_cache_usage_perc" in names
    assert "vllm:kv_cache_usage_perc" not in names
