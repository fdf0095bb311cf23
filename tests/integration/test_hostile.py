"""Hostile input: fuzzed request bodies and headers, deep JSON, slow clients, garbage
heartbeats. The router answers 4xx or succeeds, never 5xx, and never stops working.

The property-based tests are synchronous (Hypothesis drives them), so the router, two
simulators and their heartbeats run in a background thread with its own event loop.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_sync
import yaml
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lab.devstack.valkey import free_port
from lab.sim.config import SimConfig
from lab.sim.server import SimServer
from router.app import HOLDER, RouterSettings, build_app, router_site
from router.config_loader import parse_config
from tests.conftest import ROOT, within
from tests.integration.conftest import FAST
from tests.integration.test_security_fleet import (
    API_KEYS,
    CHAT,
    FleetFactory,
    auth_section,
    heartbeat_for,
    secure_fleet,
)
from worker.heartbeat_keys import HeartbeatKeys
from worker.publisher import HeartbeatPublisher
from worker.redis_client import connect

__all__ = ["secure_fleet"]
pytestmark = pytest.mark.integration

ACME = {"Authorization": f"Bearer {API_KEYS['acme']}"}


class LiveRouter:
    """The router app and two simulators (us-east, eu-west) on loopback, served by an
    event loop in a background thread so that synchronous clients can call them."""

    def __init__(self, redis_url: str, auth: dict[str, Any],
                 extra: dict[str, Any] | None = None) -> None:
        self.redis_url = redis_url
        self.key_prefix = f"gptest-{uuid.uuid4().hex[:10]}"
        self._auth = auth
        self._extra = extra or {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="live-router",
                                        daemon=True)
        self._sims: list[SimServer] = []
        self._runner: web.AppRunner | None = None
        self.port = 0

    def start(self) -> LiveRouter:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(60)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _start(self) -> None:
        publisher = HeartbeatPublisher(connect(self.redis_url), HeartbeatKeys(self.key_prefix),
                                       signer=None)
        try:
            for seq, region in enumerate(("us-east", "eu-west")):
                settings_: dict[str, Any] = {**FAST, "served_model_names": ("m",), "seed": seq}
                sim = SimServer(SimConfig(**settings_))
                await sim.start()
                self._sims.append(sim)
                await publisher.publish(heartbeat_for(f"sim-{region}", region, sim.url, seq,
                                                      ttl_s=3600))
        finally:
            await publisher.aclose()
        config = parse_config({
            "apiVersion": "globalpool/v1",
            "redis": {"url": self.redis_url, "key_prefix": self.key_prefix},
            "router": {"region": "us-east", "max_body_bytes": 65536,
                       "timeouts": {"connect_s": 1, "first_byte_s": 10, "idle_s": 10,
                                    "total_s": 20}},
            "regions": {"us-east": {"rtt_ms": {"eu-west": 80}, "models": ["m"]},
                        "eu-west": {"models": ["m"]}},
            "heartbeat": {"insecure": True},  # unsigned heartbeats, as the test writes them
            "auth": self._auth,
            **self._extra,
        })
        app = build_app(RouterSettings(config=config, redis_url=self.redis_url,
                                       region="us-east", seed=1, heartbeat_keys={}))
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        self.port = free_port()
        await router_site(self._runner, "127.0.0.1", self.port).start()
        deadline = time.monotonic() + 10
        while len(app[HOLDER].current.workers) < 2:
            assert time.monotonic() < deadline, "the router never saw the simulators"
            await asyncio.sleep(0.02)

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        for sim in self._sims:
            await sim.stop()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        """One request on a fresh connection; reads the whole answer (streams included)."""
        status, _, answer = self.exchange(method, path, body, headers)
        return status, answer

    def exchange(self, method: str, path: str, body: bytes | None = None,
                 headers: dict[str, str] | None = None,
                 ) -> tuple[int, http.client.HTTPMessage, bytes]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            connection.request(method, path, body=body, headers=headers or {})
            response = connection.getresponse()
            return response.status, response.headers, response.read()
        finally:
            connection.close()


@pytest.fixture(scope="module")
def live_router(redis_url: str) -> Iterator[LiveRouter]:
    router = LiveRouter(redis_url, auth_section()).start()
    yield router
    router.stop()


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=30),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20,
)
CONTENT = st.one_of(st.text(max_size=40), JSON_VALUES,
                    st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                    "text": st.text(max_size=20)}), max_size=3))
MESSAGES = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]) | JSON_VALUES},
    optional={"content": CONTENT, "name": JSON_VALUES}), max_size=4)
NUMBERS = st.one_of(st.none(), st.integers(-5, 40), st.integers(-2**40, 2**40),
                    st.floats(allow_nan=False), st.text(max_size=5))


@st.composite
def request_bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    """Raw bytes, any JSON, or a valid request with a few fields changed to odd values."""
    path = draw(st.sampled_from(["/v1/chat/completions", "/v1/chat/completions",
                                 "/v1/completions", "/v1/embeddings"]))
    kind = draw(st.sampled_from(["raw", "json", "shaped", "shaped", "shaped", "shaped"]))
    if kind == "raw":
        return path, draw(st.binary(max_size=200))
    if kind == "json":
        return path, json.dumps(draw(JSON_VALUES)).encode()
    text = draw(st.text(max_size=30))
    document: dict[str, Any] = {"model": "m", "max_tokens": draw(st.integers(1, 8)),
                                "stream": draw(st.booleans())}
    if path == "/v1/chat/completions":
        document["messages"] = [{"role": "user", "content": text}]
    elif path == "/v1/completions":
        document["prompt"] = text
    else:
        document["input"] = text
    fields = {
        "model": st.sampled_from(["other", ""]) | JSON_VALUES, "messages": MESSAGES,
        "prompt": CONTENT, "input": CONTENT, "max_tokens": NUMBERS,
        "max_completion_tokens": NUMBERS, "n": NUMBERS, "temperature": NUMBERS,
        "stream": JSON_VALUES, "stream_options": JSON_VALUES, "extra": JSON_VALUES,
    }
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=2, unique=True)):
        document[name] = draw(fields[name])
    return path, json.dumps(document).encode()


def test_fuzzed_request_bodies_never_get_a_5xx(live_router: LiveRouter) -> None:
    seen: dict[int, int] = {}

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(request=request_bodies())
    def check(request: tuple[str, bytes]) -> None:
        path, body = request
        status, headers, answer = live_router.exchange(
            "POST", path, body, {**ACME, "Content-Type": "application/json"})
        seen[status] = seen.get(status, 0) + 1
        assert status < 500, (status, body, answer[:300])
        # The router's own refusals are OpenAI JSON; an engine's 4xx passes through as is
        # (the simulator's 400 for an embeddings input it cannot read, for one).
        if status >= 400 and "x-globalpool-worker" not in headers:
            error = json.loads(answer)["error"]
            assert set(error) == {"message", "type", "param", "code"}

    check()
    assert seen.get(200, 0) > 0 and any(400 <= s < 500 for s in seen), seen


def test_fuzzed_headers_never_get_a_5xx(live_router: LiveRouter) -> None:
    header_text = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=60)

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(authorization=st.one_of(header_text, st.just(ACME["Authorization"])),
           region=st.one_of(st.none(), header_text, st.just("eu-west")),
           content_type=header_text)
    def check(authorization: str, region: str | None, content_type: str) -> None:
        headers = {"Authorization": authorization, "Content-Type": content_type}
        if region is not None:
            headers["x-globalpool-client-region"] = region
        status, answer = live_router.request("POST", "/v1/chat/completions",
                                             json.dumps(CHAT).encode(), headers)
        assert status < 500, (status, headers, answer[:300])
        assert API_KEYS["acme"].encode() not in answer

    check()


def test_garbage_heartbeats_never_stop_the_collector(live_router: LiveRouter) -> None:
    client = redis_sync.Redis.from_url(live_router.redis_url)
    keys = HeartbeatKeys(live_router.key_prefix)
    valid = json.loads(heartbeat_for("x", "us-east", "http://127.0.0.1:9", 1).to_json())

    def mutated(draw_value: Any, field: str) -> bytes:
        return json.dumps({**valid, field: draw_value}).encode()

    payloads = st.one_of(
        st.binary(max_size=300),
        st.text(max_size=100).map(str.encode),
        JSON_VALUES.map(lambda v: json.dumps(v).encode()),
        st.builds(mutated, JSON_VALUES, st.sampled_from(sorted(valid))),
        st.just(b"gone:"), st.text(max_size=30).map(lambda t: f"gone:{t}".encode()),
    )

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
    @given(payload=payloads, as_key=st.booleans())
    def check(payload: bytes, as_key: bool) -> None:
        if as_key:
            client.set(keys.worker(f"garbage-{uuid.uuid4().hex[:6]}"), payload, px=5000)
        client.publish(keys.channel, payload)

    try:
        check()
        # Still following Redis: a new worker shows up, and requests are served.
        fresh = heartbeat_for("late-worker", "us-east", "http://127.0.0.1:9", 1, ttl_s=30)
        client.set(keys.worker("late-worker"), fresh.to_json(), px=30_000)
        client.publish(keys.channel, fresh.to_json())
        deadline = time.monotonic() + 10
        while True:
            status, answer = live_router.request("GET", "/health")
            if json.loads(answer)["workers"] >= 3:
                break
            assert time.monotonic() < deadline, answer
            time.sleep(0.05)
        client.delete(keys.worker("late-worker"))
        client.publish(keys.channel, keys.gone_message("late-worker"))
        status, _ = live_router.request("POST", "/v1/chat/completions",
                                        json.dumps(CHAT).encode(), ACME)
        assert status == 200
    finally:
        client.close()


def test_deeply_nested_json_is_refused(live_router: LiveRouter) -> None:
    def nested(depth: int) -> bytes:
        inner = "[" * depth + "]" * depth
        return ('{"model": "m", "messages": [{"role": "user", "content": "hi"}], "x": '
                + inner + "}").encode()

    status, answer = live_router.request("POST", "/v1/chat/completions", nested(70), ACME)
    assert status == 400 and b"deeper than 64 levels" in answer
    status, answer = live_router.request("POST", "/v1/chat/completions", nested(30000), ACME)
    assert status in (400, 413)
    status, _ = live_router.request("POST", "/v1/chat/completions", nested(20), ACME)
    assert status == 200


async def test_a_slow_body_gets_408(secure_fleet: FleetFactory) -> None:
    fleet = await secure_fleet({"a": "us-east"}, router={"client_timeouts": {"body_s": 0.5}})
    host, port = fleet.urls[0].removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Authorization: Bearer " + API_KEYS["acme"].encode() +
                     b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"mo")
        await writer.drain()
        started = time.monotonic()
        async with asyncio.timeout(10):
            status_line = await reader.readline()
        assert status_line.startswith(b"HTTP/1.1 408"), status_line
        assert 0.4 < time.monotonic() - started < 5
    finally:
        writer.close()


@pytest.fixture
def router_process(tmp_path: Path, redis_url: str) -> Iterator[tuple[int, Path]]:
    """`globalpool router` as a real process (its `run()` sets the server's timeouts)."""
    port = free_port()
    config = tmp_path / "regions.yaml"
    config.write_text(yaml.safe_dump({
        "apiVersion": "globalpool/v1",
        "redis": {"url": redis_url, "key_prefix": f"gptest-{uuid.uuid4().hex[:10]}"},
        "router": {"region": "us-east", "port": port, "client_timeouts": {"header_s": 0.5}},
        "regions": {"us-east": {"models": ["m"]}},
    }))
    log = tmp_path / "router.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GLOBALPOOL_")}
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "router.cli", "router", "--config", str(config)],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + 20
        while b"router listening on" not in log.read_bytes():  # printed once bound
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        yield port, log
    finally:
        process.terminate()
        process.wait(10)


async def test_slow_headers_are_cut_off_and_auth_off_is_announced(
    router_process: tuple[int, Path],
) -> None:
    port, log = router_process
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        await writer.drain()
        started = time.monotonic()
        # The server closes the connection without waiting for the rest of the headers.
        assert await within(reader.read(), 10) == b""
        assert time.monotonic() - started < 5
    finally:
        writer.close()
    text = log.read_text()
    assert "client authentication is OFF" in text
    # No keys and no heartbeat.insecure: it says it believes no heartbeat at all.
    assert "no heartbeat signing keys" in text and "every heartbeat is refused" in text
