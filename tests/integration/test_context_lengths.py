"""A fleet whose workers of one model have different context lengths (`--max-model-len`):
each request goes to a worker whose context it fits, and one refused as too long is tried
on a longer one before the client hears of it.

Runs `globalpool up` as a user would: us-east, the router's region, has two engines of
2,048 tokens; eu-west one of 16,384, 80 ms away. Before routing knew contexts, a request
from us-east longer than 2,048 tokens went to us-east (the nearest, least loaded) and
its client got that engine's 400, though eu-west could serve it; a `max_tokens` past the
room left was cut short there (vLLM 0.32 trims it to the context, finish reason
`length`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Mapping
from typing import Any

import aiohttp
import pytest

from tests.integration.operators_fleet import scrape, value
from tests.integration.stack import RunningUp, drill_config, pid_alive, start_up

pytestmark = pytest.mark.integration

FROM_US_EAST = {"x-globalpool-client-region": "us-east"}
SHORT, LONG = 2048, 16384


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningUp]:
    tmp_path = tmp_path_factory.mktemp("contexts")
    fast = {"decode_step_ms": 1, "decode_step_ms_per_seq": 0, "prefill_tokens_per_s": 1e6}
    config = drill_config(tmp_path, regions={
        "us-east": {"rtt_ms": {"eu-west": 80}, "models": ["tiny-llama"],
                    "simulated": {"workers": 2, "max_model_len": SHORT, **fast}},
        "eu-west": {"models": ["tiny-llama"],
                    "simulated": {"workers": 1, "max_model_len": LONG, **fast}},
    })
    running = start_up(tmp_path, config)
    try:
        asyncio.run(_until_every_context_is_known(running.url))
        yield running
    finally:
        assert running.stop() == 0, running.output()
        assert [pid for pid in running.all_pids() if pid_alive(pid)] == []


async def _until_every_context_is_known(url: str) -> None:
    """Until the router's view has all three workers and its model card their longest
    context (all three heartbeats have come, with their contexts)."""
    deadline = time.monotonic() + 30.0
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            async with session.get(f"{url}/health") as health:
                workers = (await health.json())["workers"]
            async with session.get(f"{url}/v1/models") as models:
                cards = (await models.json())["data"]
            if workers == 3 and cards and cards[0].get("max_model_len") == LONG:
                return
            await asyncio.sleep(0.2)
    raise AssertionError(f"the router did not see the three workers' contexts: {cards}")


async def chat(url: str, body: dict[str, Any]) -> tuple[int, Mapping[str, str], Any]:
    """POST /v1/chat/completions from a us-east client: (status, headers, JSON or the SSE
    text)."""
    async with aiohttp.ClientSession() as session, session.post(
            f"{url}/v1/chat/completions", json=body, headers=FROM_US_EAST) as response:
        if response.content_type == "text/event-stream":
            return response.status, response.headers.copy(), await response.text()
        return response.status, response.headers.copy(), await response.json()


def ask(content: str | list[str], **fields: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": part}
                for part in ([content] if isinstance(content, str) else content)]
    return {"model": "tiny-llama", "messages": messages, **fields}


async def too_long_refusals(url: str) -> float:
    return value(await scrape(url), "globalpool_attempt_failures_total", failure="too_long")


async def test_the_model_card_gives_the_longest_context_a_request_can_get(
        up: RunningUp) -> None:
    async with aiohttp.ClientSession() as session, session.get(
            f"{up.url}/v1/models/tiny-llama") as response:
        assert response.status == 200
        assert (await response.json())["max_model_len"] == LONG


async def test_a_short_request_stays_at_home(up: RunningUp) -> None:
    for _ in range(5):
        status, headers, answer = await chat(up.url, ask("hello", max_tokens=4))
        assert status == 200, answer
        assert headers["x-globalpool-region"] == "us-east"


@pytest.mark.parametrize("stream", [False, True])
async def test_a_prompt_longer_than_the_home_context_is_served_where_it_fits(
        up: RunningUp, stream: bool) -> None:
    refused_before = await too_long_refusals(up.url)
    prompt = "word " * 2400  # 3,000 tokens: more than us-east's 2,048
    body = ask(prompt, max_tokens=8, stream=stream,
               **({"stream_options": {"include_usage": True}} if stream else {}))
    status, headers, answer = await chat(up.url, body)
    assert status == 200, answer
    assert headers["x-globalpool-region"] == "eu-west"
    assert headers["x-globalpool-route"] != "retry"  # its first attempt: none refused
    if stream:
        assert '"prompt_tokens":3000' in answer and answer.rstrip().endswith("data: [DONE]")
    else:
        assert answer["usage"]["prompt_tokens"] == 3000
    assert await too_long_refusals(up.url) == refused_before


async def test_max_tokens_past_the_home_context_is_not_cut_short(up: RunningUp) -> None:
    status, headers, answer = await chat(up.url, ask("count", max_tokens=3000,
                                                     ignore_eos=True))
    assert status == 200, answer
    assert headers["x-globalpool-region"] == "eu-west"
    # us-east would have cut it to its context: 2,046 tokens and finish reason `length`.
    assert answer["usage"]["completion_tokens"] == 3000


async def test_a_prompt_the_router_counts_short_is_refused_at_home_and_served_away(
        up: RunningUp) -> None:
    # 3,000 two-character messages: the router counts 6,000 characters (1,500 tokens);
    # the engine counts the separators between them too (2,250 tokens), as a real chat
    # template adds tokens per message. us-east's engine refuses it.
    refused_before = await too_long_refusals(up.url)
    status, headers, answer = await chat(up.url, ask(["ab"] * 3000, max_tokens=4))
    assert status == 200, answer
    assert headers["x-globalpool-region"] == "eu-west"
    assert headers["x-globalpool-route"] == "retry"
    assert "retry;dur=" in headers["server-timing"]
    assert answer["usage"]["prompt_tokens"] == 2250
    assert await too_long_refusals(up.url) == refused_before + 1


@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_too_long_for_every_context_gets_the_engines_400_at_once(
        up: RunningUp, stream: bool) -> None:
    refused_before = await too_long_refusals(up.url)
    started = time.monotonic()
    status, headers, answer = await chat(up.url, ask("word " * 16000, max_tokens=8,
                                                     stream=stream))
    assert status == 400, answer
    assert headers["Content-Type"].startswith("application/json")
    error = answer["error"]
    assert "maximum context length is 16384 tokens" in error["message"]
    assert "127.0." not in str(answer)
    # Sent to the longest context only, which refused it: one attempt, no retry.
    assert await too_long_refusals(up.url) == refused_before + 1
    assert time.monotonic() - started < 5.0


async def test_max_tokens_above_every_context_is_the_engines_400(up: RunningUp) -> None:
    status, _, answer = await chat(up.url, ask("hello", max_tokens=20000))
    assert status == 400, answer
    assert "greater than max_model_len=16384" in answer["error"]["message"]


async def test_a_prompt_of_token_ids_is_counted_by_its_ids(up: RunningUp) -> None:
    # The completions API with a prompt of token ids: 3,000 tokens, no text at all.
    async with aiohttp.ClientSession() as session, session.post(
            f"{up.url}/v1/completions", headers=FROM_US_EAST,
            json={"model": "tiny-llama", "prompt": list(range(3000)), "max_tokens": 4}
    ) as response:
        answer = await response.json()
        assert response.status == 200, answer
        assert response.headers["x-globalpool-region"] == "eu-west"
        assert response.headers["x-globalpool-route"] != "retry"
    assert answer["usage"]["prompt_tokens"] == 3000



async def _faults(up: RunningUp, name: str, **knobs: object) -> None:
    url = next(str(c["url"]) for c in up.children() if c["name"] == name)
    async with aiohttp.ClientSession() as session, session.post(
            f"{url}/sim/faults", json=knobs) as response:
        assert response.status == 200, await response.text()


async def test_an_engine_that_names_a_context_beyond_its_own_cannot_make_a_request_hopeless(
        up: RunningUp) -> None:
    # Both us-east engines answer every request "too long for a context of 1,000,000,000
    # tokens": their heartbeats say 2,048. Taken at their word, no worker's context was
    # longer, and a short request got that 400 at once; counted for 2,048, it is tried on
    # eu-west's 16,384 and served.
    for name in ("sim-us-east-1", "sim-us-east-2"):
        await _faults(up, name, misbehave="too_long_lie")
    try:
        answers = [await chat(up.url, ask("hello", max_tokens=4)) for _ in range(4)]
    finally:
        for name in ("sim-us-east-1", "sim-us-east-2"):
            await _faults(up, name, misbehave="none")
    for status, headers, answer in answers:
        assert status == 200, answer
        assert headers["x-globalpool-region"] == "eu-west"


async def test_a_long_request_whose_only_fitting_worker_failed_gets_that_failure(
        up: RunningUp) -> None:
    # eu-west's engine, the only one long enough, fails; the retry goes to a us-east
    # engine, which refuses it as too long for 2,048 tokens. That 400 says the request
    # cannot be served, which is not so: the client would not send it again. It gets the
    # failure of the worker that could serve it (5xx, Retry-After). (Last in the module:
    # eu-west's failures count against it.)
    await _faults(up, "sim-eu-west-1", error_rate=1.0)
    try:
        status, headers, answer = await chat(up.url, ask("word " * 2400, max_tokens=8))
    finally:
        await _faults(up, "sim-eu-west-1", error_rate=0.0)
    assert status == 502, answer
    assert headers["Retry-After"] == "1"
    assert answer["error"]["code"] == "upstream_failed"
    assert "maximum context length" not in answer["error"]["message"]
    assert "127.0." not in str(answer)
