"""The simulator's Responses API against what the real vLLM 0.32 answered
(tests/fixtures/vllm-0.32-cpu-responses.json, tests/vllm/capture_responses.py): the same
keys and value types, the same events in the same order and framing, the same errors."""

from __future__ import annotations

import asyncio
import json
from itertools import groupby
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI

from lab.sim.server import SimServer
from tests.integration.conftest import StartSim

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
REAL = json.loads((ROOT / "tests" / "fixtures" / "vllm-0.32-cpu-responses.json").read_text())
CASES = REAL["cases"]
HI = {"model": "tiny-llama", "input": "Hi", "max_output_tokens": 8}
UNKNOWN = "resp_doesnotexist"


def shape(value: Any) -> Any:
    """Keys and value types, recursively (lists by their first item)."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return "number" if isinstance(value, int | float) and not isinstance(value, bool) else (
        type(value).__name__)


async def call(http: aiohttp.ClientSession, method: str, url: str,
               body: Any = None) -> tuple[int, Any]:
    async with http.request(method, url, json=body) as response:
        return response.status, await response.json()


async def stream(http: aiohttp.ClientSession, method: str, url: str,
                 body: Any = None) -> tuple[str, list[dict[str, Any]]]:
    """The raw text of a stream and its events ({"event", "data"})."""
    async with http.request(method, url, json=body) as response:
        assert response.status == 200
        assert response.headers["Content-Type"] == CASES["create_stream"]["content_type"]
        text = await response.text()
    events = []
    for block in text.split("\n\n")[:-1]:
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        events.append({"event": name[7:], "data": json.loads(data[6:])})
    return text, events


def names(events: list[dict[str, Any]]) -> list[str]:
    """Event names, a run of deltas as one (their count is the answer's length)."""
    return [name for name, _ in groupby(event["event"] for event in events)]


def the_real(case: dict[str, Any], response_id: str | None = None) -> tuple[int, Any]:
    """A captured error answer, for `response_id` instead of the captured one."""
    body = json.dumps(case["response"])
    if response_id is not None:
        captured = case["request"]["path"].split("/")[3]
        body = body.replace(captured, response_id)
    return case["status"], json.loads(body)


async def test_a_response_has_the_real_servers_shape(sim: SimServer,
                                                     http: aiohttp.ClientSession) -> None:
    status, body = await call(http, "POST", sim.url + "/v1/responses", HI)
    assert status == 200
    assert shape(body) == shape(CASES["create"]["response"])
    assert list(body) == list(CASES["create"]["response"])  # same order, too
    assert body["status"] == "incomplete" and body["max_output_tokens"] == 8
    assert body["id"].startswith("resp_") and body["output"][0]["id"].startswith("msg_")
    assert (status, body) == await call(http, "GET", f"{sim.url}/v1/responses/{body['id']}")


async def test_a_stream_sends_the_real_servers_events_in_order(
        sim: SimServer, http: aiohttp.ClientSession) -> None:
    text, events = await stream(http, "POST", sim.url + "/v1/responses", {**HI, "stream": True})
    real = CASES["create_stream"]
    assert names(events) == names(real["events"])
    assert [event["data"]["sequence_number"] for event in events] == list(range(len(events)))
    assert all(event["data"]["type"] == event["event"] for event in events)
    by_name = {event["event"]: event["data"] for event in real["events"]}
    for event in events:
        assert shape(event["data"]) == shape(by_name[event["event"]]), event["event"]
        assert list(event["data"]) == list(by_name[event["event"]])
    # The id comes first, where the real server has it; no [DONE].
    response_id = events[0]["data"]["response"]["id"]
    assert text.find(response_id) == real["framing"]["first_resp_id_at_byte"] + 1
    assert text.startswith(real["framing"]["first_block"][:48])
    assert "[DONE]" not in text and text.endswith('"type":"response.completed"}\n\n')
    final = events[-1]["data"]["response"]
    deltas = "".join(e["data"]["delta"] for e in events if e["event"].endswith("delta"))
    assert final["output"][0]["content"][0]["text"] == deltas
    assert (await call(http, "GET", f"{sim.url}/v1/responses/{response_id}"))[1] == final


async def test_unknown_ids_and_refused_cancels_answer_as_vllm(
        sim: SimServer, http: aiohttp.ClientSession) -> None:
    _, first = await call(http, "POST", sim.url + "/v1/responses", HI)
    url = sim.url + "/v1/responses/"
    assert await call(http, "GET", url + UNKNOWN) == the_real(CASES["get_unknown"])
    assert await call(http, "POST", url + UNKNOWN + "/cancel") == the_real(
        CASES["cancel_unknown"])
    assert await call(http, "POST", f"{url}{first['id']}/cancel") == the_real(
        CASES["cancel_finished"])
    assert await call(http, "POST", sim.url + "/v1/responses",
                      {**HI, "previous_response_id": UNKNOWN}) == the_real(
        CASES["previous_response_id_unknown"])
    assert await call(http, "POST", sim.url + "/v1/responses",
                      {**HI, "model": "no-such"}) == the_real(CASES["model_unknown"])


async def test_store_false_is_not_kept(sim: SimServer, http: aiohttp.ClientSession) -> None:
    _, body = await call(http, "POST", sim.url + "/v1/responses", {**HI, "store": False})
    assert shape(body) == shape(CASES["store_false"]["response"])
    assert await call(http, "GET", f"{sim.url}/v1/responses/{body['id']}") == the_real(
        CASES["get_store_false"], body["id"])
    assert await call(http, "POST", sim.url + "/v1/responses",
                      {**HI, "background": True, "store": False}) == the_real(
        CASES["background_store_false"])


async def test_messages_instructions_and_a_follow_up_grow_the_prompt(
        sim: SimServer, http: aiohttp.ClientSession) -> None:
    real = CASES["input_messages_and_instructions"]
    _, first = await call(http, "POST", sim.url + "/v1/responses", real["request"]["body"])
    assert shape(first) == shape(real["response"])
    assert first["instructions"] == "Answer briefly."
    _, second = await call(http, "POST", sim.url + "/v1/responses",
                           {**HI, "input": "And then?", "previous_response_id": first["id"]})
    assert shape(second) == shape(CASES["previous_response_id"]["response"])
    assert second["previous_response_id"] == first["id"]
    assert len(second["output"]) == 1  # only this turn's answer, as vLLM
    # Its prompt holds the first turn's input and output, then its own input.
    assert second["usage"]["input_tokens"] > first["usage"]["output_tokens"] + 2


async def test_the_store_keeps_the_newest(start_sim: StartSim,
                                          http: aiohttp.ClientSession) -> None:
    sim = await start_sim(responses_store_max=3)
    ids = [(await call(http, "POST", sim.url + "/v1/responses", HI))[1]["id"]
           for _ in range(5)]
    found = [(await call(http, "GET", f"{sim.url}/v1/responses/{rid}"))[0] for rid in ids]
    assert found == [404, 404, 200, 200, 200]


async def test_without_a_store_store_is_ignored_and_background_refused(
        start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    sim = await start_sim(responses_store_max=0)
    _, body = await call(http, "POST", sim.url + "/v1/responses", HI)
    assert (await call(http, "GET", f"{sim.url}/v1/responses/{body['id']}"))[0] == 404
    status, refusal = await call(http, "POST", sim.url + "/v1/responses",
                                 {**HI, "background": True})
    assert status == 400 and refusal["error"]["param"] == "background"


async def test_background_is_queued_until_done_and_can_be_cancelled(
        start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    sim = await start_sim(decode_step_ms=5.0)
    real = CASES["background"]
    status, queued = await call(http, "POST", sim.url + "/v1/responses",
                                {**HI, "background": True})
    assert status == 200 and shape(queued) == shape(real["create"]["response"])
    seen = [queued["status"]]
    while seen[-1] == "queued":
        await asyncio.sleep(0.01)
        seen.append((await call(http, "GET", f"{sim.url}/v1/responses/{queued['id']}"))[1][
            "status"])
    assert [s for s, _ in groupby(seen)] == real["status_flow_by_get"]
    _, running = await call(http, "POST", sim.url + "/v1/responses",
                            {**HI, "background": True, "max_output_tokens": 1500})
    url = f"{sim.url}/v1/responses/{running['id']}"
    status, cancelled = await call(http, "POST", url + "/cancel")
    assert status == 200 and cancelled["status"] == "cancelled"
    assert shape(cancelled) == shape(real["cancel_running"]["cancel"]["response"])
    await asyncio.sleep(0.05)
    assert (await call(http, "GET", url))[1] == cancelled
    assert await call(http, "POST", url + "/cancel") == the_real(
        real["cancel_running"]["cancel_again"])
    async with http.get(sim.url + "/metrics") as response:
        assert 'vllm:num_requests_running{engine="0",model_name="tiny-llama"} 0.0' in (
            await response.text())  # the cancel freed the slot


async def test_a_background_stream_can_be_followed_again(
        sim: SimServer, http: aiohttp.ClientSession) -> None:
    real = CASES["background"]
    _, events = await stream(http, "POST", sim.url + "/v1/responses",
                             {**HI, "background": True, "stream": True})
    assert names(events) == names(real["stream"]["events"])
    response_id = events[0]["data"]["response"]["id"]
    _, again = await stream(
        http, "GET", f"{sim.url}/v1/responses/{response_id}?stream=true&starting_after=3")
    assert again == events[4:]


async def test_a_response_is_stored_only_once_it_finished(
        start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    sim = await start_sim(decode_step_ms=20.0)
    body = {**HI, "stream": True, "max_output_tokens": 200}
    async with http.post(sim.url + "/v1/responses", json=body) as response:
        head = await response.content.readuntil(b"\n\n")
        response_id = json.loads(head.split(b"data: ", 1)[1])["response"]["id"]
        assert await call(http, "GET", f"{sim.url}/v1/responses/{response_id}") == the_real(
            CASES["get_while_streaming"]["during"], response_id)


async def test_fault_knobs_apply(sim: SimServer, http: aiohttp.ClientSession) -> None:
    await call(http, "POST", sim.url + "/sim/faults", {"error_rate": 1.0})
    assert (await call(http, "POST", sim.url + "/v1/responses", HI))[0] == 500
    await call(http, "POST", sim.url + "/sim/faults",
               {"error_rate": 0.0, "mid_stream_error_rate": 1.0})
    with pytest.raises(aiohttp.ClientPayloadError):
        await stream(http, "POST", sim.url + "/v1/responses", {**HI, "stream": True})


async def test_the_openai_client_creates_streams_retrieves_and_follows_up(
        sim: SimServer) -> None:
    async with AsyncOpenAI(base_url=sim.url + "/v1", api_key="unused", max_retries=0) as client:
        first = await client.responses.create(model="tiny-llama", input="Hi",
                                              max_output_tokens=8)
        assert first.output_text and first.status == "incomplete"
        assert (await client.responses.retrieve(first.id)).output_text == first.output_text
        follow_up = await client.responses.create(model="tiny-llama", input="And then?",
                                                  previous_response_id=first.id)
        assert follow_up.usage is not None and first.usage is not None
        assert follow_up.usage.input_tokens > first.usage.input_tokens
        events = [event async for event in await client.responses.create(
            model="tiny-llama", input=[{"role": "user", "content": "Hi"}],
            instructions="Be brief.", max_output_tokens=4, stream=True)]
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert sum(event.type == "response.output_text.delta" for event in events) == 4


async def test_a_client_may_name_the_response(sim: SimServer,
                                              http: aiohttp.ClientSession) -> None:
    """vLLM's extra field `request_id` becomes the response's id."""
    _, body = await call(http, "POST", sim.url + "/v1/responses", {**HI, "request_id": "resp_mine"})
    assert body["id"] == "resp_mine"
    assert (await call(http, "GET", sim.url + "/v1/responses/resp_mine"))[0] == 200
