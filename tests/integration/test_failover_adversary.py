"""Mid-stream failover (issue 26) probed with real processes: the client reads one
uninterrupted stream whatever happens to the engines under it.

Real Valkey, a real router (its own front, in process, as in test_proxy) and simulator
processes (`lab.sim`) that are SIGKILLed or SIGSTOPped mid-stream, at a token count the
test chooses; another process or an in-process simulator continues the stream. The stream
readers and the router fixture here serve test_failover_adversary_wire too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from lab.devstack.valkey import free_port
from router.app import HOLDER, RouterSettings, build_app, router_site
from router.config_loader import parse_config
from tests.conftest import ROOT
from tests.integration.conftest import StartSim
from tests.integration.operators_fleet import scrape, value
from tests.integration.test_proxy import cleaned_up
from tests.integration.test_sim_cli import LAUNCH
from tests.integration.test_stream_failover import CHAT, COMPLETION, TOKENS
from worker.heartbeat_keys import HeartbeatKeys
from worker.publisher import HeartbeatPublisher
from worker.redis_client import connect
from worker.schema import Capacity, Heartbeat, LifecycleState, Load

pytestmark = pytest.mark.integration

CHAT_PATH = "/v1/chat/completions"


# --- reading a stream ----------------------------------------------------------------


def raw_events(body: bytes) -> list[str]:
    """The `data:` payloads of the stream, undecoded."""
    out: list[str] = []
    for event in body.decode(errors="replace").split("\n\n"):
        data = "\n".join(line[5:].strip() for line in event.splitlines()
                         if line.startswith("data:"))
        if data:
            out.append(data)
    return out


def events_of(body: bytes) -> list[Any]:
    """Decoded payloads; an event that is not JSON fails the test with the stream."""
    events: list[Any] = []
    for data in raw_events(body):
        if data == "[DONE]":
            events.append(data)
            continue
        try:
            events.append(json.loads(data))
        except ValueError:
            pytest.fail(f"the client got an event that is not JSON: {data!r}\n{body!r}")
    return events


def errors_in(events: list[Any]) -> list[dict[str, Any]]:
    """The error events among `events`."""
    return [e for e in events if isinstance(e, dict) and "error" in e]


def texts_of(chunks: list[Any], kind: str) -> list[str]:
    """The text of each choice, the chat role event left out (`kind`: chat, completions)."""
    choices = [choice for c in chunks if isinstance(c, dict) for choice in c.get("choices", [])]
    if kind == "chat":
        return [choice["delta"].get("content") or "" for choice in choices
                if "role" not in choice["delta"]]
    return [choice.get("text") or "" for choice in choices]


def assert_one_whole_stream(body: bytes, kind: str, tokens: int = TOKENS,
                            usage: bool = True) -> str:
    """What one healthy worker would have sent: one id, created and model, choice 0, one
    role event, `tokens` tokens, one finish reason, one usage chunk (if `usage`), one
    [DONE], no error. Returns the answer's text."""
    events = events_of(body)
    assert events and events[-1] == "[DONE]" and events.count("[DONE]") == 1, body
    chunks = events[:-1]
    assert not errors_in(chunks), body
    assert len({c["id"] for c in chunks}) == 1, body
    assert len({c["created"] for c in chunks}) == 1 and {c["model"] for c in chunks} == {"m"}
    choices = [choice for c in chunks for choice in c["choices"]]
    assert {choice["index"] for choice in choices} == {0}
    assert len([choice for choice in choices if choice["finish_reason"]]) == 1, body
    if kind == "chat":
        assert sum("role" in choice["delta"] for choice in choices) == 1, body
    texts = texts_of(chunks, kind)
    assert sum(1 for text in texts if text) == tokens, body
    usages = [c["usage"] for c in chunks if c.get("usage") and not c["choices"]]
    if usage:
        assert len(usages) == 1, body
        assert usages[0]["completion_tokens"] == tokens, body
        assert usages[0]["total_tokens"] == usages[0]["prompt_tokens"] + tokens
    else:
        assert usages == [], body
    return "".join(texts)


def token_events(line_buffer: bytes, kind: str = "chat") -> int:
    """Token-carrying events among the whole events of `line_buffer`."""
    count = 0
    for data in raw_events(line_buffer.rsplit(b"\n\n", 1)[0] + b"\n\n"):
        if data == "[DONE]":
            continue
        with contextlib.suppress(ValueError):
            count += sum(1 for text in texts_of([json.loads(data)], kind) if text)
    return count


# --- simulator processes -------------------------------------------------------------


@dataclass
class SimProcess:
    process: asyncio.subprocess.Process
    url: str

    sent: set[int] = field(default_factory=set)

    def signal(self, signum: int, once: bool = True) -> None:
        """Send `signum` to this process (only the first time, if `once`)."""
        if (once and signum in self.sent) or self.process.returncode is not None:
            return
        self.sent.add(signum)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.process.pid, signum)


SpawnSim = Callable[..., Awaitable[SimProcess]]


@pytest.fixture
async def sim_processes() -> AsyncIterator[SpawnSim]:
    """Simulator processes (killed, by their own pid, afterwards)."""
    started: list[SimProcess] = []

    async def spawn(seed: int = 0, decode_step_ms: float = 30.0) -> SimProcess:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-c", LAUNCH, "--port", "0", "--served-model-name", "m",
            "--seed", str(seed), "--decode-step-ms", str(decode_step_ms),
            "--decode-step-ms-per-seq", "0", "--prefill-tokens-per-s", "1000000",
            cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
        assert process.stdout is not None
        async with asyncio.timeout(20):
            line = await process.stdout.readline()
        match = re.fullmatch(rb"sim listening on (http://127\.0\.0\.1:\d+)\n", line)
        assert match, line
        sim = SimProcess(process, match.group(1).decode())
        started.append(sim)
        return sim

    yield spawn
    for sim in started:
        if sim.process.returncode is None:
            sim.signal(signal.SIGCONT, once=False)
            with contextlib.suppress(ProcessLookupError):
                sim.process.kill()
        async with asyncio.timeout(10):
            await sim.process.wait()


def signal_at(sim: SimProcess, signum: int, tokens: int) -> Callable[[int], Awaitable[None]]:
    """An `on_tokens` for `stream_with`: `signum` to `sim` once the client has `tokens`."""

    async def on_tokens(count: int) -> None:
        if count >= tokens:
            sim.signal(signum)

    return on_tokens


# --- the router ----------------------------------------------------------------------


StartRouter = Callable[..., Awaitable[str]]


@pytest.fixture
async def start_router(redis_url: str, key_prefix: str) -> AsyncIterator[StartRouter]:
    """`await start_router(*urls)`: a router (its URL) in front of workers named a, b, c...
    in us-east, one a URL, ranked in that order: `a` idle, each next one with 30 more
    requests waiting, so that `a` is the first pick and `b` the first to continue."""
    runners: list[web.AppRunner] = []
    publisher = HeartbeatPublisher(connect(redis_url), HeartbeatKeys(key_prefix))
    seq = iter(range(1, 1_000_000))

    async def start(*urls: str) -> str:
        for rank, url in enumerate(urls):
            await publisher.publish(Heartbeat(
                worker_id="abc"[rank], region="us-east", endpoint=url, models=("m",),
                state=LifecycleState.READY, capacity=Capacity(max_num_seqs=8),
                load=Load(running=0, waiting=30 * rank, kv_cache_usage=0.0),
                seq=next(seq), sent_at_s=time.time(), ttl_s=60.0))
        raw: dict[str, Any] = {
            "apiVersion": "globalpool/v1",
            "router": {"region": "us-east", "near_equal_ms": 0.5, "policy": "predicted_ttft",
                       "timeouts": {"connect_s": 1, "first_byte_s": 2, "idle_s": 1,
                                    "total_s": 15}},
            "heartbeat": {"insecure": True},
            "regions": {"us-east": {"models": ["m"]}},
            "redis": {"url": redis_url, "key_prefix": key_prefix},
        }
        app = build_app(RouterSettings(config=parse_config(raw), redis_url=redis_url,
                                       region="us-east", seed=1))
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        port = free_port()
        await router_site(runner, "127.0.0.1", port, shutdown_timeout_s=5).start()
        runners.append(runner)
        deadline = time.monotonic() + 5
        while len(app[HOLDER].current.workers) < len(urls):
            assert time.monotonic() < deadline, "router never saw the heartbeats"
            await asyncio.sleep(0.02)
        return f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await cleaned_up(runner)
    await publisher.aclose()


# --- clients -------------------------------------------------------------------------


async def post_stream(url: str, path: str, body: dict[str, Any],
                      headers: dict[str, str] | None = None,
                      timeout_s: float = 15) -> tuple[int, str, bytes]:
    """The status, the worker that began the stream, and the whole stream."""
    async with aiohttp.ClientSession() as session, session.post(
            f"{url}{path}", json=body, headers=headers or {}) as response:
        async with asyncio.timeout(timeout_s):
            data = await response.read()
        return response.status, response.headers.get("x-globalpool-worker", ""), data


async def stream_with(url: str, path: str, body: dict[str, Any],
                      on_tokens: Callable[[int], Awaitable[None]] | None = None,
                      kind: str = "chat", timeout_s: float = 15) -> tuple[str, bytes]:
    """Read a stream piece by piece, calling `on_tokens(count)` as its token count grows."""
    received = b""
    async with aiohttp.ClientSession() as session, session.post(
            f"{url}{path}", json=body) as response:
        assert response.status == 200, await response.read()
        worker = response.headers.get("x-globalpool-worker", "")
        deadline = time.monotonic() + timeout_s
        seen = 0
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"the stream did not end in {timeout_s} s: {received!r}"
            async with asyncio.timeout(left):
                piece = await response.content.readany()
            if not piece:
                break
            received += piece
            count = token_events(received, kind)
            if on_tokens is not None and count != seen:
                seen = count
                await on_tokens(count)
    return worker, received


# === engines killed and stalled =====================================================


async def test_an_engine_sigkilled_mid_stream_is_continued(
        start_router: StartRouter, sim_processes: SpawnSim, start_sim: StartSim) -> None:
    a = await sim_processes(seed=1)
    b = await start_sim(served_model_names=("m",), seed=2)
    router = await start_router(a.url, b.url)
    worker, answer = await stream_with(router, CHAT_PATH, {**CHAT, "max_tokens": 30},
                                       signal_at(a, signal.SIGKILL, tokens=4))
    assert worker == "a"
    assert_one_whole_stream(answer, "chat", tokens=30)


async def test_an_engine_sigstopped_mid_stream_is_continued_after_idle_s(
        start_router: StartRouter, sim_processes: SpawnSim, start_sim: StartSim) -> None:
    # The stopped engine keeps its connection open and says nothing: the router's idle_s
    # (1 s here) is what calls it broken.
    a = await sim_processes(seed=1)
    b = await start_sim(served_model_names=("m",), seed=2)
    router = await start_router(a.url, b.url)
    try:
        worker, answer = await stream_with(router, "/v1/completions",
                                           {**COMPLETION, "max_tokens": 30},
                                           signal_at(a, signal.SIGSTOP, tokens=4),
                                           kind="completions")
    finally:
        a.signal(signal.SIGCONT, once=False)
    assert worker == "a"
    assert_one_whole_stream(answer, "completions", tokens=30)


async def test_an_engine_that_dies_during_the_continuation_too(
        start_router: StartRouter, sim_processes: SpawnSim, start_sim: StartSim) -> None:
    # a dies after 3 tokens, b (which continues) after 4 more of its own: c ends it.
    a = await sim_processes(seed=1)
    b = await sim_processes(seed=2)
    c = await start_sim(served_model_names=("m",), seed=3)
    router = await start_router(a.url, b.url, c.url)
    killed: dict[str, int] = {}

    async def kill(count: int) -> None:
        if "a" not in killed and count >= 3:
            a.signal(signal.SIGKILL)
            killed["a"] = count
        elif "a" in killed and "b" not in killed and count >= killed["a"] + 4:
            b.signal(signal.SIGKILL)  # a is dead: these tokens came from b
            killed["b"] = count

    _, answer = await stream_with(router, CHAT_PATH, {**CHAT, "max_tokens": 40}, kill)
    assert set(killed) == {"a", "b"}
    assert_one_whole_stream(answer, "chat", tokens=40)
    metrics = await scrape(router)  # b did continue it (and died), then c
    assert value(metrics, "globalpool_routing_decisions_total", reason="continuation") >= 2


async def test_n_above_1_is_not_continued_nor_passed_off_as_finished(
        start_router: StartRouter, sim_processes: SpawnSim) -> None:
    # n=2, max_tokens=12: the engine dies after ~6 tokens of each choice. Neither choice is
    # whole and n > 1 is never continued, so the client gets the error event (and the
    # metric its reason). Before, the router counted both choices' tokens against
    # max_tokens and ended the stream as finished.
    a = await sim_processes(seed=1, decode_step_ms=100.0)
    router = await start_router(a.url)
    _, answer = await stream_with(router, CHAT_PATH, {**CHAT, "n": 2, "stream_options": None},
                                  signal_at(a, signal.SIGKILL, tokens=TOKENS))
    events = events_of(answer)
    per_choice = {0: 0, 1: 0}
    for chunk in events[:-1]:
        for choice in chunk.get("choices", []):
            if (choice.get("delta") or {}).get("content"):
                per_choice[choice["index"]] += 1
    assert min(per_choice.values()) < TOKENS, answer  # the engine did die mid-answer
    assert errors_in(events), f"a cut n=2 stream ended as if complete: {answer!r}"
    metrics = await scrape(router)
    assert value(metrics, "globalpool_stream_failovers_total",
                 outcome="not_continued", reason="n > 1") >= 1
