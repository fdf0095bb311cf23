"""Three simulated regions behind the router, driven through the unchanged `openai` client."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import aiohttp
import openai
import pytest

from tests.integration.stack import RunningUp, pid_alive, small_config, start_up

pytestmark = pytest.mark.integration

CHAT: Any = [{"role": "user", "content": "Hello from the tests, how are you?"}]


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningUp]:
    tmp_path = tmp_path_factory.mktemp("topology")
    running = start_up(tmp_path, small_config(tmp_path))
    try:
        yield running
    finally:
        code = running.stop()
        leftovers = [pid for pid in running.all_pids() if pid_alive(pid)]
        assert code == 0, running.output()
        assert leftovers == [], f"processes left behind: {leftovers}"


def client(up: RunningUp, region: str | None = None) -> openai.OpenAI:
    headers = {"x-globalpool-client-region": region} if region else None
    return openai.OpenAI(base_url=f"{up.url}/v1", api_key="unused", default_headers=headers,
                         max_retries=0, timeout=30)


def test_models_are_the_union_over_regions(up: RunningUp) -> None:
    ids = {model.id for model in client(up).models.list()}
    assert ids == {"tiny-llama", "tiny-coder"}


def test_chat_non_streaming(up: RunningUp) -> None:
    raw = client(up).chat.completions.with_raw_response.create(
        model="tiny-llama", messages=CHAT, max_tokens=8)
    completion = raw.parse()
    assert completion.choices[0].message.content
    assert completion.usage is not None and completion.usage.completion_tokens == 8
    assert raw.headers["x-globalpool-region"] == "us-east"
    assert raw.headers["x-globalpool-worker"].startswith("us-east-")
    timing = raw.headers["server-timing"]
    assert "route;dur=" in timing and "upstream;dur=" in timing


def test_chat_streaming_with_usage(up: RunningUp) -> None:
    with client(up).chat.completions.with_streaming_response.create(
        model="tiny-llama", messages=CHAT, max_tokens=12, stream=True,
        stream_options={"include_usage": True},
    ) as response:
        assert response.headers["x-globalpool-region"] == "us-east"
        chunks = list(response.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and
              c.choices[0].finish_reason]
    assert finish == ["length"]


def test_completions_streaming_and_not(up: RunningUp) -> None:
    api = client(up)
    completion = api.completions.create(model="tiny-llama", prompt="Once upon", max_tokens=5)
    assert completion.choices[0].text
    pieces = list(api.completions.create(model="tiny-llama", prompt="Once upon", max_tokens=5,
                                         stream=True))
    assert "".join(p.choices[0].text for p in pieces if p.choices)


@pytest.mark.parametrize("region", ["us-east", "eu-west", "ap-south"])
def test_requests_stay_in_the_clients_region_when_it_has_room(up: RunningUp, region: str) -> None:
    api = client(up, region)
    served = Counter(
        api.chat.completions.with_raw_response.create(
            model="tiny-llama", messages=CHAT, max_tokens=2
        ).headers["x-globalpool-region"]
        for _ in range(10)
    )
    assert served == Counter({region: 10})


def test_model_served_elsewhere_goes_there(up: RunningUp) -> None:
    raw = client(up, "us-east").chat.completions.with_raw_response.create(
        model="tiny-coder", messages=CHAT, max_tokens=2)
    assert raw.headers["x-globalpool-region"] == "eu-west"


async def _post(session: aiohttp.ClientSession, url: str, body: bytes | str,
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, object]]:
    async with session.post(url, data=body, headers=headers or {}) as response:
        return response.status, await response.json(content_type=None)


@pytest.mark.parametrize(
    ("path", "body", "status", "fragment"),
    [
        ("/v1/chat/completions", "{not json", 400, "not valid JSON"),
        ("/v1/chat/completions", "[1, 2]", 400, "JSON object"),
        ("/v1/chat/completions", json.dumps({"messages": CHAT}), 400, "'model' is required"),
        ("/v1/chat/completions", json.dumps({"model": "tiny-llama"}), 400, "'messages'"),
        ("/v1/chat/completions", json.dumps({"model": "tiny-llama", "messages": CHAT,
                                             "stream": "yes"}), 400, "'stream'"),
        ("/v1/completions", json.dumps({"model": "tiny-llama"}), 400, "'prompt' is required"),
        ("/v1/chat/completions", json.dumps({"model": "gpt-9", "messages": CHAT}), 404,
         "gpt-9"),
        ("/v1/chat/completions", json.dumps({"model": "tiny-llama", "messages": CHAT,
                                             "pad": "x" * 5_000_000}), 413, "too large"),
        ("/v1/nothing", "{}", 404, "no route"),
    ],
)
async def test_bad_input_gets_openai_errors(
    up: RunningUp, path: str, body: str, status: int, fragment: str
) -> None:
    async with aiohttp.ClientSession() as session:
        got_status, payload = await _post(session, up.url + path, body,
                                          {"Content-Type": "application/json"})
    assert got_status == status
    error = payload["error"]
    assert isinstance(error, dict)
    assert fragment in error["message"]
    assert set(error) == {"message", "type", "param", "code"}


async def test_wrong_method_and_unknown_client_region(up: RunningUp) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(up.url + "/v1/chat/completions") as response:
            assert response.status == 405
            assert "not allowed" in (await response.json())["error"]["message"]
        status, payload = await _post(
            session, up.url + "/v1/chat/completions",
            json.dumps({"model": "tiny-llama", "messages": CHAT}),
            {"x-globalpool-client-region": "mars"})
        assert status == 400
        assert "no region named 'mars'" in str(payload)


async def test_loaded_region_spills_to_the_next_best(up: RunningUp) -> None:
    """Fill us-east's engines directly, then the router sends us-east clients elsewhere."""
    sims = [c["url"] for c in up.children("sim") if c["region"] == "us-east"]
    long_request = json.dumps({"model": "tiny-llama", "messages": CHAT, "max_tokens": 400,
                               "ignore_eos": True})
    async with aiohttp.ClientSession() as session:
        load = [asyncio.create_task(_post(session, f"{sim}/v1/chat/completions", long_request))
                for sim in sims for _ in range(12)]
        try:
            await asyncio.sleep(0.8)  # a few heartbeats carry the queue to the router
            regions: Counter[str] = Counter()
            for _ in range(6):
                async with session.post(
                    up.url + "/v1/chat/completions",
                    json={"model": "tiny-llama", "messages": CHAT, "max_tokens": 2},
                    headers={"x-globalpool-client-region": "us-east"},
                ) as response:
                    assert response.status == 200
                    regions[response.headers["x-globalpool-region"]] += 1
            assert regions["us-east"] == 0, regions
            assert regions["eu-west"] == 6  # 80 ms away beats ap-south's 190 ms
        finally:
            for task in load:
                task.cancel()
            await asyncio.gather(*load, return_exceptions=True)


def test_up_printed_what_runs_where(up: RunningUp) -> None:
    output = up.output()
    assert "globalpool is up" in output
    assert "curl" in output and "from openai import OpenAI" in output
    for child in up.children():
        assert str(child["pid"]) in output


def test_the_openai_clients_other_calls_work_against_up(up: RunningUp) -> None:
    """The surface beyond chat with the unchanged client: a Responses conversation
    continued and retrieved as a client in another region, embeddings, a model card, an
    audio transcription."""
    east, west = client(up), client(up, "ap-south")
    first = east.responses.with_raw_response.create(model="tiny-llama", input="Hello",
                                                    max_output_tokens=8)
    holder = first.headers["x-globalpool-worker"]
    # us-east, or eu-west while the test before's load still drains from us-east's engines
    assert not holder.startswith("ap-south-"), holder
    answer = first.parse()
    follow = west.responses.with_raw_response.create(
        model="tiny-llama", input="and then?", previous_response_id=answer.id,
        max_output_tokens=4)
    assert follow.headers["x-globalpool-worker"] == holder  # not ap-south's own workers
    assert follow.parse().previous_response_id == answer.id
    assert west.responses.retrieve(answer.id).output_text == answer.output_text
    with pytest.raises(openai.NotFoundError):
        west.responses.retrieve("resp_0000000000000000")
    vectors = west.embeddings.create(model="tiny-llama", input=["a", "b"])
    assert len(vectors.data) == 2 and vectors.data[0].embedding
    assert east.models.retrieve("tiny-coder").id == "tiny-coder"
    heard = east.audio.transcriptions.create(model="tiny-llama",
                                             file=("a.wav", b"RIFF" + bytes(4096), "audio/wav"))
    assert heard.text
