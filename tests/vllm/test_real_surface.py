"""The OpenAI surface beyond chat, against real vLLM through one endpoint: forced tool calls,
a Responses conversation that crosses regions, and embeddings from a pooling-runner server.
Run with `pytest -m vllm` (see conftest.py); `.ci/run` always does.

The pool is this module's own (conftest.py's module-scoped `pool`); the pooling server is
started for its one test and stopped after it. The model has random weights: only what
vLLM enforces (a tool call's JSON schema, a stored conversation, an embedding's size) is
checked, never the text.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import jsonschema  # type: ignore[import-untyped]  # ships no type information
import openai
import pytest
from openai.types.chat import ChatCompletionToolParam

from tests.vllm.pool import (
    EMBED_ARGS,
    EMBED_MODEL,
    GENERATE_ARGS,
    MAX_MODEL_LEN,
    MODEL,
    START_TIMEOUT_S,
    Agent,
    RealPool,
    pss_mib,
)
from tests.vllm.tiny_model import HIDDEN
from worker.schema import LifecycleState

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

WORKER = "x-globalpool-worker"
ROUTE = "x-globalpool-route"
EXACT = {"ignore_eos": True}  # exact lengths (vLLM's Responses API takes it too)
TURN_TOKENS = 8
ASK: Any = [{"role": "user", "content": "Book a table for tonight, or tell me the weather."}]
# Small closed schemas: the random model fills whatever the grammar allows, so enums and
# bounded integers keep every call short.
SCHEMAS: dict[str, dict[str, Any]] = {
    "get_weather": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Boston", "Tokyo"]},
                       "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False,
    },
    "book_table": {
        "type": "object",
        "properties": {"seats": {"type": "integer", "minimum": 1, "maximum": 8},
                       "outdoor": {"type": "boolean"}},
        "required": ["seats", "outdoor"], "additionalProperties": False,
    },
}
TOOLS: list[ChatCompletionToolParam] = [
    {"type": "function",
     "function": {"name": name, "description": f"{name} (test tool)", "parameters": schema}}
    for name, schema in SCHEMAS.items()
]
Served = TypeVar("Served")


def served_in(worker_id: str, send: Callable[[], tuple[str, Served]], timeout_s: float = 60.0,
              ) -> tuple[Served, int]:
    """Send until the answer comes from `worker_id`; (that answer, how many were sent).
    A fresh request from a region is normally served there, but not while this machine's
    stalls make its heartbeats report a slow engine (test_real_vllm.py, until_served_in)."""
    deadline = time.monotonic() + timeout_s
    seen: list[str] = []
    while time.monotonic() < deadline:
        served_by, answer = send()
        seen.append(served_by)
        if served_by == worker_id:
            return answer, len(seen)
        time.sleep(0.5)
    raise AssertionError(f"not served by {worker_id} in {timeout_s:g} s: {seen}")


def check_tool_call(name: str, arguments: str, named: str | None) -> None:
    """One of the offered tools (the named one when `named`), with arguments that are JSON
    valid against that tool's schema."""
    assert name in SCHEMAS, name
    if named is not None:
        assert name == named
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("choice", ["required", "book_table"])
def test_forced_tool_calls_are_valid_calls_streaming_and_not(pool: RealPool, choice: str,
                                                             ) -> None:
    """tool_choice "required" or a named function: vLLM constrains the output to the
    tools' schemas (pool.GENERATE_ARGS), so even random weights give a valid call; the
    router passes `tools`, `tool_choice` and the streamed tool-call deltas through as they
    are."""
    client = pool.client("us-east")
    named = None if choice == "required" else choice
    tool_choice: Any = choice if named is None else {"type": "function",
                                                     "function": {"name": named}}
    workers = {agent.worker_id for agent in pool.agents.values()}

    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice,
        parallel_tool_calls=False, max_tokens=200)
    assert raw.headers[WORKER] in workers
    message = raw.parse().choices[0].message
    assert message.tool_calls is not None and len(message.tool_calls) == 1, message
    call = message.tool_calls[0]
    assert call.type == "function" and call.id
    check_tool_call(call.function.name, call.function.arguments, named)

    with client.chat.completions.with_streaming_response.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice,
        parallel_tool_calls=False, max_tokens=200, stream=True,
    ) as response:
        assert response.headers[WORKER] in workers
        chunks = list(response.parse())
    deltas = [call for chunk in chunks if chunk.choices
              for call in chunk.choices[0].delta.tool_calls or []]
    assert deltas and {delta.index for delta in deltas} == {0}, deltas
    # The first delta names the function and has the call's id; the rest add arguments.
    assert deltas[0].id and deltas[0].function and deltas[0].function.name
    assert all(delta.id is None for delta in deltas[1:])
    arguments = "".join(delta.function.arguments or "" for delta in deltas if delta.function)
    check_tool_call(deltas[0].function.name, arguments, named)


def test_a_responses_conversation_continues_on_its_engine_from_either_region(
    pool: RealPool, measurements: dict[str, Any]
) -> None:
    """A stored response lives in one engine's memory. Created in us-east, it is continued
    and retrieved through a replica in eu-west by a client in eu-west, and is served by
    us-east's engine; the other way round with a stream (its record is written from the
    stream's first event)."""
    east_worker = pool.agents["us-east"].worker_id
    west_worker = pool.agents["eu-west"].worker_id
    west_url, west_router = pool.start_router("--region", "eu-west")
    pool.routers.append(west_router)
    east = pool.client("us-east")
    west = pool.client("eu-west", url=west_url)

    def create_in_east() -> tuple[str, Any]:
        raw = east.responses.with_raw_response.create(
            model=MODEL, input="Which region holds this conversation?",
            max_output_tokens=TURN_TOKENS, extra_body=EXACT)
        return raw.headers[WORKER], raw.parse()

    first, sent_east = served_in(east_worker, create_in_east)
    assert first.id.startswith("resp_") and first.output_text
    assert first.usage and first.usage.output_tokens == TURN_TOKENS

    started = time.monotonic()
    raw = west.responses.with_raw_response.create(
        model=MODEL, input="And then?", max_output_tokens=TURN_TOKENS, extra_body=EXACT,
        previous_response_id=first.id)
    second_turn_s = time.monotonic() - started
    second = raw.parse()
    assert raw.headers[WORKER] == east_worker, "continued where the conversation is"
    assert second.previous_response_id == first.id and second.id != first.id
    assert second.output_text
    assert second.usage and second.usage.output_tokens == TURN_TOKENS
    # The engine read the first turn: its prompt and answer come before the new input.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens

    raw_retrieved = west.responses.with_raw_response.retrieve(first.id)
    assert raw_retrieved.headers[WORKER] == east_worker
    retrieved = raw_retrieved.parse()
    assert (retrieved.id, retrieved.output_text) == (first.id, first.output_text)

    with pytest.raises(openai.NotFoundError):
        west.responses.retrieve("resp_0000000000000000")
    with pytest.raises(openai.NotFoundError) as unknown_previous:
        west.responses.create(model=MODEL, input="Hi", max_output_tokens=8,
                              previous_response_id="resp_0000000000000000")
    assert unknown_previous.value.code == "previous_response_not_found"

    # The other way round: streamed in eu-west (a client there is served there, which is
    # what makes the continuation's route above mean something), continued from us-east.
    def stream_in_west() -> tuple[str, list[Any]]:
        with west.responses.with_streaming_response.create(
            model=MODEL, input="Which region holds this one?",
            max_output_tokens=TURN_TOKENS, extra_body=EXACT, stream=True,
        ) as response:
            return response.headers[WORKER], list(response.parse())

    events, sent_west = served_in(west_worker, stream_in_west)
    assert events[0].type == "response.created", events[0]
    assert events[-1].type == "response.completed", events[-1]
    streamed_id = events[0].response.id
    raw = east.responses.with_raw_response.create(
        model=MODEL, input="And then?", max_output_tokens=TURN_TOKENS, extra_body=EXACT,
        previous_response_id=streamed_id)
    assert raw.headers[WORKER] == west_worker
    assert raw.parse().previous_response_id == streamed_id
    assert east.responses.retrieve(streamed_id).id == streamed_id

    measurements["responses: second turn via eu-west, served in us-east (s)"] = round(
        second_turn_s, 2)
    measurements["responses: creates sent until served locally (us-east, eu-west)"] = (
        sent_east, sent_west)


def until_listed(client: openai.OpenAI, model: str, timeout_s: float = 30.0) -> None:
    """Until the router's /v1/models (the models of its live workers) has `model`."""
    deadline = time.monotonic() + timeout_s
    while model not in (listed := [card.id for card in client.models.list()]):
        assert time.monotonic() < deadline, f"{model} not listed in {timeout_s:g} s: {listed}"
        time.sleep(0.1)


@pytest.fixture
def embedder(pool: RealPool, measurements: dict[str, Any]) -> Iterator[Agent]:
    """A third vLLM server, the tiny model under the pooling runner, served as
    EMBED_MODEL in us-east on 127.0.3.1; stopped after the test with nothing left."""
    agent = pool.start_agent("us-east", 2, name="embed", served_name=EMBED_MODEL,
                             engine_args=EMBED_ARGS)
    try:
        pool.wait_for_state("embed", LifecycleState.READY, timeout_s=START_TIMEOUT_S)
        measurements["time to ready, pooling server (s)"] = round(
            time.monotonic() - agent.started_at, 1)
        measurements["vLLM memory at start, pooling server (PSS MiB)"] = round(
            pss_mib(agent.engine_tree()))
        until_listed(pool.client(), EMBED_MODEL)
        yield agent
    finally:
        leftovers = pool.stop_agent("embed")
        assert leftovers == [], f"pooling server processes left behind: {leftovers}"


def test_embeddings_are_served_by_the_pooling_server(pool: RealPool, embedder: Agent) -> None:
    beat = pool.heartbeat("embed")
    assert beat is not None and beat.models == (EMBED_MODEL,)
    inputs = ["alpha beta", "the router in front", "alpha beta"]
    for region in ("us-east", "eu-west"):  # the only server of the model is in us-east
        raw = pool.client(region).embeddings.with_raw_response.create(
            model=EMBED_MODEL, input=inputs)
        assert raw.headers[WORKER] == embedder.worker_id
        answer = raw.parse()
        assert answer.model == EMBED_MODEL
        assert [item.index for item in answer.data] == [0, 1, 2]
        vectors = [item.embedding for item in answer.data]
        assert [len(vector) for vector in vectors] == [HIDDEN] * 3
        assert all(math.isfinite(x) for vector in vectors for x in vector)
        assert vectors[0] == vectors[2] != vectors[1], "the same input, the same vector"
        assert answer.usage.prompt_tokens > 0
    again = pool.client("us-east").embeddings.create(model=EMBED_MODEL, input=inputs[1])
    assert again.data[0].embedding == vectors[1], "deterministic across requests"

    # Chat still goes to the generate servers, never to the one that cannot answer it.
    for _ in range(4):
        raw_chat = pool.client("us-east").chat.completions.with_raw_response.create(
            model=MODEL, messages=ASK, max_tokens=2)
        assert raw_chat.headers[WORKER] != embedder.worker_id
        assert raw_chat.parse().choices[0].message.content is not None


# A third generate server of the model with a short context, alone in a third region: its
# clients' nearest worker, and the only one whose context their long requests do not fit.
SHORT_CONTEXT = 256
SHORT_REGION = "ap-south"


@pytest.fixture
def short_context(pool: RealPool, measurements: dict[str, Any]) -> Iterator[tuple[Agent, str]]:
    """The short server (`--max-model-len 256`, on 127.0.4.1) and a router that knows its
    region (the pool's router refuses heartbeats from a region its regions.yaml lacks);
    stopped after the test with nothing left."""
    agent = pool.start_agent(SHORT_REGION, 3, name="short", engine_args=(
        *GENERATE_ARGS, "--max-model-len", str(SHORT_CONTEXT)))
    router: subprocess.Popen[bytes] | None = None
    try:
        pool.wait_for_state("short", LifecycleState.READY, timeout_s=START_TIMEOUT_S)
        measurements["time to ready, short-context server (s)"] = round(
            time.monotonic() - agent.started_at, 1)
        url, router = pool.start_router(regions={SHORT_REGION: {
            "rtt_ms": {SHORT_REGION: 1, "us-east": 190, "eu-west": 120}, "models": [MODEL]}})
        pool.wait_router_sees(url, 3)
        yield agent, url
    finally:
        if router is not None:
            router.terminate()
            router.wait(timeout=30)
        leftovers = pool.stop_agent("short")
        assert leftovers == [], f"short-context server processes left behind: {leftovers}"


def test_requests_go_to_a_context_they_fit_and_a_refusal_is_tried_on_a_longer_one(
        pool: RealPool, short_context: tuple[Agent, str],
        measurements: dict[str, Any]) -> None:
    agent, url = short_context
    beat = pool.heartbeat("short")
    assert beat is not None and beat.capacity.max_model_len == SHORT_CONTEXT
    home = pool.heartbeat("us-east")
    assert home is not None and home.capacity.max_model_len == MAX_MODEL_LEN
    client = pool.client(SHORT_REGION, url=url)
    assert client.models.retrieve(MODEL).model_extra == {"max_model_len": MAX_MODEL_LEN}

    # Short: served at home, by the short server.
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=ASK,
                                                           max_tokens=4)
    assert raw.headers[WORKER] == agent.worker_id

    # Longer than 256 tokens by the router's count too: sent away at once.
    before = refusals(url, "too_long")
    long_text: Any = [{"role": "user", "content": "the router in front of the pool " * 60}]
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=long_text,
                                                           max_tokens=4)
    assert raw.headers[WORKER] != agent.worker_id and raw.headers[ROUTE] != "retry"
    usage = raw.parse().usage
    assert usage is not None and usage.prompt_tokens > SHORT_CONTEXT
    assert refusals(url, "too_long") == before

    # Short by the router's count (4 characters a token), long by the tokenizer's: text it
    # never learnt (this tokenizer's merges are of English and code) is 2-3 tokens a
    # character. The short server's vLLM refuses it; the router tries a longer context.
    unknown_text: Any = [{"role": "user", "content": "路由器在池的前面" * 25}]
    started = time.monotonic()
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=unknown_text,
                                                           max_tokens=4)
    measurements["refused for length, then served elsewhere (s)"] = round(
        time.monotonic() - started, 2)
    assert raw.headers[WORKER] != agent.worker_id and raw.headers[ROUTE] == "retry"
    usage = raw.parse().usage
    assert usage is not None and usage.prompt_tokens > SHORT_CONTEXT
    assert refusals(url, "too_long") == before + 1

    # Too long for every context: the engine's own 400, after one attempt.
    with pytest.raises(openai.BadRequestError, match=f"maximum context length is "
                                                     f"{MAX_MODEL_LEN} tokens"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "the router " * 3000}],
            max_tokens=4)
    assert refusals(url, "too_long") == before + 2


def refusals(url: str, failure: str) -> float:
    """The router's count of attempts that failed with `failure` (a worker's refusal)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("globalpool_attempt_failures_total{")
               and f'failure="{failure}"' in line)



ADAPTER = "sql-lora"
LORA_ARGS = (*GENERATE_ARGS, "--enable-lora", "--max-lora-rank", "8", "--max-loras", "1")


@pytest.fixture
def lora_servers(pool: RealPool, vllm_python: Path, tiny_model: Path,
                 tmp_path: Path, measurements: dict[str, Any]) -> Iterator[tuple[Agent, Agent]]:
    """Two more generate servers of the model with runtime LoRA updating, one in us-east
    (127.0.5.1) and one in eu-west (127.0.6.1), both with ADAPTER loaded through vLLM's
    /v1/load_lora_adapter; stopped after the test."""
    adapter = tmp_path / ADAPTER
    subprocess.run([str(vllm_python), str(Path(__file__).parent / "tiny_lora.py"),
                    str(tiny_model), str(adapter)], check=True, stdin=subprocess.DEVNULL)
    runtime = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    home = pool.start_agent("us-east", 4, name="lora-home", engine_args=LORA_ARGS,
                            engine_env=runtime)
    away = pool.start_agent("eu-west", 5, name="lora-away", engine_args=LORA_ARGS,
                            engine_env=runtime)
    try:
        for name in ("lora-home", "lora-away"):
            pool.wait_for_state(name, LifecycleState.READY, timeout_s=START_TIMEOUT_S)
        measurements["time to ready, two LoRA servers (s)"] = round(
            time.monotonic() - home.started_at, 1)
        for agent in (home, away):
            engine_post(agent, "/v1/load_lora_adapter",
                        {"lora_name": ADAPTER, "lora_path": str(adapter)})
        for name in ("lora-home", "lora-away"):
            until_adapters(pool, name, lambda adapters: ADAPTER in adapters)
        pool.wait_router_sees(pool.router_url, 4)
        time.sleep(1.0)  # the heartbeats with the adapter reach the router
        yield home, away
    finally:
        for name in ("lora-home", "lora-away"):
            leftovers = pool.stop_agent(name)
            assert leftovers == [], f"LoRA server processes left behind: {leftovers}"


def engine_post(agent: Agent, path: str, body: dict[str, Any]) -> None:
    """POST `body` to the agent's vLLM itself (its LoRA admin endpoints); 200 expected."""
    request = urllib.request.Request(f"{agent.engine_url}{path}", method="POST",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:  # raises on a 4xx/5xx
        assert response.status == 200


def until_adapters(pool: RealPool, name: str, wanted: Callable[[tuple[str, ...]], bool],
                   timeout_s: float = 30.0) -> None:
    """Until agent `name`'s stored heartbeat lists LoRA adapters that are `wanted`."""
    deadline = time.monotonic() + timeout_s
    while not wanted(((beat := pool.heartbeat(name)) and beat.lora_adapters) or ()):
        assert time.monotonic() < deadline, f"{name}'s adapters never changed as wanted"
        time.sleep(0.2)


def test_an_adapter_unloaded_before_the_heartbeat_says_so_is_served_by_another_worker(
        pool: RealPool, lora_servers: tuple[Agent, Agent],
        measurements: dict[str, Any]) -> None:
    home, away = lora_servers
    client = pool.client("us-east")

    def ask_adapter() -> Any:
        return client.chat.completions.with_raw_response.create(
            model=ADAPTER, messages=ASK, max_tokens=4)

    assert ask_adapter().headers[WORKER] in (home.worker_id, away.worker_id)
    refused_before = refusals(pool.router_url, "not_served")
    # The home agent is stopped while its engine unloads the adapter: the router's view is
    # the heartbeat before (as in the interval before an agent's next probe, here for as
    # long as the test needs it, well within the heartbeat's TTL).
    os.kill(home.process.pid, signal.SIGSTOP)
    try:
        engine_post(home, "/v1/unload_lora_adapter", {"lora_name": ADAPTER})
        started = time.monotonic()
        raw = ask_adapter()
        measurements["adapter unloaded: refused at home, served away (s)"] = round(
            time.monotonic() - started, 2)
    finally:
        os.kill(home.process.pid, signal.SIGCONT)
    # Sent to the nearest worker with the adapter by the router's view, us-east's: vLLM's
    # 404 there, then eu-west's answer.
    assert raw.headers[WORKER] == away.worker_id and raw.headers[ROUTE] == "retry"
    assert raw.parse().model == ADAPTER
    assert refusals(pool.router_url, "not_served") == refused_before + 1

    # Once the heartbeat says so, nothing more is sent there for the adapter.
    until_adapters(pool, "lora-home", lambda adapters: ADAPTER not in adapters)
    time.sleep(1.0)  # the heartbeat reaches the router
    for _ in range(3):
        assert ask_adapter().headers[WORKER] == away.worker_id
    assert refusals(pool.router_url, "not_served") == refused_before + 1
