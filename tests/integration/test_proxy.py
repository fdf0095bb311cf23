"""The proxy path against real simulators, a real Valkey and the real router app, in-process.

The test plays the worker agents' part by publishing heartbeats with the real publisher,
so it controls exactly what the router believes about each worker.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import aiohttp
import openai
import pytest
from aiohttp import web

from lab.devstack.valkey import EmbeddedValkey, free_port
from lab.sim.server import SimServer
from router.app import HOLDER, RouterSettings, build_app, router_site
from router.config_loader import parse_config
from tests.integration.conftest import StartSim
from worker.heartbeat_keys import HeartbeatKeys
from worker.publisher import HeartbeatPublisher
from worker.redis_client import connect
from worker.schema import Capacity, Heartbeat, LifecycleState, Load

pytestmark = pytest.mark.integration

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 6}


@dataclass
class Fleet:
    """A router in front of simulators whose heartbeats the test publishes."""

    router_url: str
    sims: dict[str, SimServer]
    publish: Callable[..., Awaitable[None]]
    runner: web.AppRunner  # the router's (the fixture cleans it up; cleaning it twice is fine)

    async def faults(self, worker_id: str, **knobs: object) -> None:
        async with aiohttp.ClientSession() as session, session.post(
            f"{self.sims[worker_id].url}/sim/faults", json=knobs
        ) as response:
            assert response.status == 200, await response.text()

    async def running(self, worker_id: str) -> float:
        async with aiohttp.ClientSession() as session, session.get(
            f"{self.sims[worker_id].url}/metrics"
        ) as response:
            text = await response.text()
        line = next(x for x in text.splitlines() if x.startswith("vllm:num_requests_running{"))
        return float(line.rsplit(" ", 1)[1])


FleetFactory = Callable[..., Awaitable[Fleet]]


def _config(timeouts: dict[str, float],
            client_timeouts: dict[str, float] | None = None,
            policy: str = "predicted_ttft") -> dict[str, object]:
    return {
        "apiVersion": "globalpool/v1",
        "router": {"region": "us-east", "near_equal_ms": 0.5, "timeouts": timeouts,
                   "client_timeouts": client_timeouts or {}, "policy": policy},
        "heartbeat": {"insecure": True},  # the test publishes unsigned heartbeats
        "regions": {
            "us-east": {"rtt_ms": {"eu-west": 80}, "models": ["m"]},
            "eu-west": {"models": ["m"]},
        },
    }


@pytest.fixture
async def fleet_factory(
    redis_url: str, key_prefix: str, start_sim: StartSim
) -> AsyncIterator[FleetFactory]:
    runners: list[web.AppRunner] = []
    publishers: dict[str, HeartbeatPublisher] = {}

    def publisher_for(url: str) -> HeartbeatPublisher:
        if url not in publishers:
            publishers[url] = HeartbeatPublisher(connect(url), HeartbeatKeys(key_prefix))
        return publishers[url]

    seq = iter(range(1, 1_000_000))

    async def make(workers: dict[str, str], timeouts: dict[str, float] | None = None,
                   *, redis: str = redis_url, ttl_s: float = 60.0,
                   client_timeouts: dict[str, float] | None = None,
                   policy: str = "predicted_ttft", router: dict[str, object] | None = None,
                   shutdown_timeout_s: float = 60.0, **sim_changes: object) -> Fleet:
        sims: dict[str, SimServer] = {}
        for index, (worker_id, _region) in enumerate(workers.items()):
            sims[worker_id] = await start_sim(served_model_names=("m",), seed=index,
                                              **sim_changes)

        async def publish(worker_id: str, *, running: int = 0, waiting: int = 0,
                          state: LifecycleState = LifecycleState.READY) -> None:
            await publisher_for(redis).publish(Heartbeat(
                worker_id=worker_id, region=workers[worker_id],
                endpoint=sims[worker_id].url, models=("m",), state=state,
                capacity=Capacity(max_num_seqs=8),
                load=Load(running=running, waiting=waiting, kv_cache_usage=0.0),
                seq=next(seq), sent_at_s=time.time(), ttl_s=ttl_s,
            ))

        for worker_id in workers:
            await publish(worker_id)
        raw = _config(timeouts or {"connect_s": 1, "first_byte_s": 2, "idle_s": 1,
                                   "total_s": 10}, client_timeouts, policy)
        raw["router"] = {**raw["router"], **(router or {})}  # type: ignore[dict-item]
        config = parse_config(raw | {"redis": {"url": redis, "key_prefix": key_prefix}})
        app = build_app(RouterSettings(config=config, redis_url=redis, region="us-east",
                                       seed=1))
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        port = free_port()
        await router_site(runner, "127.0.0.1", port,
                          shutdown_timeout_s=shutdown_timeout_s).start()
        runners.append(runner)
        deadline = time.monotonic() + 5
        while len(app[HOLDER].current.workers) < len(workers):
            assert time.monotonic() < deadline, "router never saw the heartbeats"
            await asyncio.sleep(0.02)
        return Fleet(f"http://127.0.0.1:{port}", sims, publish, runner)

    yield make
    for runner in runners:
        await cleaned_up(runner)
    for publisher in publishers.values():
        await publisher.aclose()


# A router's cleanup that takes longer than this fails the test with every task's stack
# (under pytest-timeout's 120 s, whose report shows only the main thread waiting in
# select: two CI runs hung in this teardown and left nothing to read).
CLEANUP_BOUND_S = 90.0


async def cleaned_up(runner: web.AppRunner) -> None:
    cleanup = asyncio.ensure_future(runner.cleanup())
    done, _ = await asyncio.wait({cleanup}, timeout=CLEANUP_BOUND_S)
    if not done:
        stacks = io.StringIO()
        for task in asyncio.all_tasks():
            task.print_stack(limit=12, file=stacks)
        cleanup.cancel()
        pytest.fail(f"the router's cleanup has not ended in {CLEANUP_BOUND_S:g} s; every "
                    f"task's stack:\n{stacks.getvalue()[-30000:]}")
    cleanup.result()


async def _chat(url: str, body: dict[str, object]) -> tuple[int, str, bytes]:
    async with aiohttp.ClientSession() as session, session.post(
        f"{url}/v1/chat/completions", json=body
    ) as response:
        return response.status, response.headers.get("x-globalpool-worker", ""), \
            await response.read()


async def test_failure_before_first_byte_is_retried_elsewhere(fleet_factory: FleetFactory) -> None:
    fleet = await fleet_factory({"a": "us-east", "b": "us-east"})
    await fleet.faults("a", error_rate=1.0)
    results = [await _chat(fleet.router_url, {**CHAT, "stream": i % 2 == 0}) for i in range(10)]
    assert [status for status, _, _ in results] == [200] * 10
    assert {worker for _, worker, _ in results} == {"b"}


async def test_every_worker_failing_gives_a_clean_502(fleet_factory: FleetFactory) -> None:
    fleet = await fleet_factory({"a": "us-east", "b": "us-east"})
    await fleet.faults("a", error_rate=1.0)
    await fleet.faults("b", error_rate=1.0)
    status, _, body = await _chat(fleet.router_url, CHAT)
    assert status == 502
    error = json.loads(body)["error"]
    assert "failed on 2 worker(s)" in error["message"]
    assert error["code"] == "upstream_failed"


async def test_hung_worker_times_out_and_is_retried(fleet_factory: FleetFactory) -> None:
    fleet = await fleet_factory({"a": "us-east", "b": "eu-west"},
                                {"connect_s": 1, "first_byte_s": 0.5, "idle_s": 1, "total_s": 1})
    await fleet.faults("a", hang=True)
    started = time.monotonic()
    status, worker, _ = await _chat(fleet.router_url, {**CHAT, "stream": True})
    assert (status, worker) == (200, "b")
    assert 0.4 < time.monotonic() - started < 3
    status, worker, _ = await _chat(fleet.router_url, CHAT)  # non-streaming: total_s bounds it
    assert (status, worker) == (200, "b")


async def test_mid_stream_failure_ends_with_an_error_event(fleet_factory: FleetFactory) -> None:
    fleet = await fleet_factory({"a": "us-east"})
    await fleet.faults("a", mid_stream_error_rate=1.0)
    client = openai.AsyncOpenAI(base_url=f"{fleet.router_url}/v1", api_key="x", max_retries=0)
    received = 0
    with pytest.raises(openai.APIError, match=r"broke off|ended early"):
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=50, stream=True)
        async for _chunk in stream:
            received += 1
    assert received >= 1  # the first bytes did reach the client: no retry was possible
    await client.close()


async def test_stalled_stream_hits_the_idle_timeout(fleet_factory: FleetFactory) -> None:
    fleet = await fleet_factory({"a": "us-east"},
                                {"connect_s": 1, "first_byte_s": 2, "idle_s": 0.4, "total_s": 10})
    async with aiohttp.ClientSession() as session, session.post(
        f"{fleet.router_url}/v1/chat/completions",
        json={**CHAT, "stream": True, "max_tokens": 200},
    ) as response:
        first = await response.content.readany()
        assert first.startswith(b"data: ")
        await fleet.faults("a", slow_factor=1000.0)  # the next decode step takes seconds
        async with asyncio.timeout(5):
            rest = await response.read()
    assert b"no data from the worker for 0.4 s" in rest
    assert rest.endswith(b"data: [DONE]\n\n")


async def test_a_stream_that_keeps_going_is_cut_at_the_total_timeout(
        fleet_factory: FleetFactory) -> None:
    fleet = await fleet_factory({"a": "us-east"},
                                {"connect_s": 1, "first_byte_s": 2, "idle_s": 0.4, "total_s": 1})
    await fleet.faults("a", slow_factor=5.0)  # a token every ~5 ms: never idle, for ~10 s
    started = time.monotonic()
    async with aiohttp.ClientSession() as session, session.post(
        f"{fleet.router_url}/v1/chat/completions",
        json={**CHAT, "stream": True, "max_tokens": 2000},
    ) as response:
        async with asyncio.timeout(8):
            rest = await response.read()
    assert 1.0 <= time.monotonic() - started < 4
    assert b"the request ran past its total timeout" in rest
    assert rest.endswith(b"data: [DONE]\n\n")


async def test_client_disconnect_cancels_the_upstream_request(fleet_factory: FleetFactory) -> None:
    fleet = await fleet_factory({"a": "us-east"})
    async with aiohttp.ClientSession() as session:
        response = await session.post(f"{fleet.router_url}/v1/chat/completions",
                                      json={**CHAT, "stream": True, "max_tokens": 2000})
        await response.content.readany()
        assert await fleet.running("a") == 1
        response.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 3
    while await fleet.running("a") != 0:
        assert time.monotonic() < deadline, "the engine kept generating for a gone client"
        await asyncio.sleep(0.05)


async def test_draining_and_degraded_workers_get_nothing(fleet_factory: FleetFactory) -> None:
    fleet = await fleet_factory({"a": "us-east", "b": "us-east", "c": "eu-west"})
    await fleet.publish("a", state=LifecycleState.DRAINING)
    await fleet.publish("b", state=LifecycleState.DEGRADED)
    await asyncio.sleep(0.2)
    served = Counter([(await _chat(fleet.router_url, CHAT))[1] for _ in range(6)])
    assert served == Counter({"c": 6})
    await fleet.publish("c", state=LifecycleState.DRAINING)
    await asyncio.sleep(0.2)
    # No `ready` worker left: a degraded one is tried rather than a certain 503 (its
    # agent may only have had a probe time out); a draining one never is.
    assert (await _chat(fleet.router_url, CHAT))[:2] == (200, "b")
    await fleet.publish("b", state=LifecycleState.DRAINING)
    await asyncio.sleep(0.2)
    status, _, body = await _chat(fleet.router_url, CHAT)
    assert status == 503
    assert json.loads(body)["error"]["code"] == "draining"


async def test_stream_passes_through_chunk_by_chunk(fleet_factory: FleetFactory) -> None:
    fleet = await fleet_factory({"a": "us-east"}, decode_step_ms=40.0)
    arrivals: list[float] = []
    async with aiohttp.ClientSession() as session, session.post(
        f"{fleet.router_url}/v1/chat/completions",
        json={**CHAT, "stream": True, "max_tokens": 8},
    ) as response:
        async for _line in response.content:
            arrivals.append(time.monotonic())
    # Chunks arrive as the engine makes them (40 ms apart), not all at the end.
    assert arrivals[-1] - arrivals[0] > 0.2
    gaps = [b - a for a, b in itertools.pairwise(arrivals) if b - a > 0.02]
    assert len(gaps) >= 5


async def test_dead_worker_is_ejected_at_once_without_waiting_for_its_ttl(
    fleet_factory: FleetFactory,
) -> None:
    fleet = await fleet_factory({"a": "us-east", "b": "us-east"})
    await fleet.sims["a"].stop()  # connections to it are refused from now on
    results = [await _chat(fleet.router_url, {**CHAT, "stream": i % 2 == 1}) for i in range(20)]
    assert [status for status, _, _ in results] == [200] * 20
    assert {worker for _, worker, _ in results} == {"b"}


async def test_engine_busy_503_is_retried_on_another_worker(fleet_factory: FleetFactory) -> None:
    fleet = await fleet_factory({"a": "us-east", "b": "eu-west"}, max_num_seqs=1,
                                max_num_queued_reqs=1)
    long = {**CHAT, "stream": True, "max_tokens": 2000}
    async with aiohttp.ClientSession() as session:
        busy = [await session.post(f"{fleet.sims['a'].url}/v1/chat/completions", json=long)
                for _ in range(2)]  # one running, one waiting: a's queue is full
        try:
            status, worker, _ = await _chat(fleet.router_url, CHAT)
            assert (status, worker) == (200, "b")
        finally:
            for response in busy:
                response.close()


async def test_engine_busy_as_an_error_event_after_200_is_retried_too(
    fleet_factory: FleetFactory,
) -> None:
    # vLLM 0.32 can admit a request, send `200 OK`, and then refuse it as an SSE error
    # event; the router has sent the client nothing yet, so it still retries elsewhere.
    fleet = await fleet_factory({"a": "us-east", "b": "eu-west"}, max_num_seqs=1,
                                max_num_queued_reqs=1)
    await fleet.faults("a", busy_in_stream=True)
    long = {**CHAT, "stream": True, "max_tokens": 2000}
    async with aiohttp.ClientSession() as session:
        busy = [await session.post(f"{fleet.sims['a'].url}/v1/chat/completions", json=long)
                for _ in range(2)]  # a's queue is full
        try:
            async with session.post(f"{fleet.sims['a'].url}/v1/chat/completions",
                                    json=long) as direct:
                assert direct.status == 200
                assert (await direct.read()).startswith(b'data: {"error": {"message": ')
            status, worker, body = await _chat(fleet.router_url,
                                               {**CHAT, "stream": True, "max_tokens": 4})
            assert (status, worker) == (200, "b")
            assert b'"error"' not in body and body.endswith(b"data: [DONE]\n\n")
        finally:
            for response in busy:
                response.close()


async def test_redis_outage_fails_static_and_recovers(fleet_factory: FleetFactory) -> None:
    server = EmbeddedValkey.start()
    try:
        fleet = await fleet_factory({"a": "us-east"}, redis=server.url, ttl_s=1.0)
        server.stop()
        deadline = time.monotonic() + 3.0  # three heartbeat TTLs without Redis
        while time.monotonic() < deadline:
            status, worker, _ = await _chat(fleet.router_url, CHAT)
            assert (status, worker) == (200, "a")
        async with aiohttp.ClientSession() as session, session.get(
            f"{fleet.router_url}/health"
        ) as response:
            health = await response.json()
        assert health["redis_connected"] is False and health["view_age_s"] > 2.0
        server = EmbeddedValkey.start(port=server.port)
        await fleet.publish("a")
        deadline = time.monotonic() + 10
        while True:
            async with aiohttp.ClientSession() as session, session.get(
                f"{fleet.router_url}/health"
            ) as response:
                health = await response.json()
            if health["redis_connected"]:
                break
            assert time.monotonic() < deadline, "the router never reconnected to Redis"
            await asyncio.sleep(0.1)
    finally:
        server.stop()


async def test_stopping_cuts_a_request_still_running_after_the_grace_and_says_which(
        fleet_factory: FleetFactory, caplog: pytest.LogCaptureFixture) -> None:
    # A stream of 40 tokens at 0.2 s each outlives the 0.5 s shutdown grace: the router
    # waits that long, cuts it, and says what it cut (a silent wait of a whole grace was
    # all a CI teardown that hung left to read).
    fleet = await fleet_factory({"a": "us-east"}, shutdown_timeout_s=0.5, decode_step_ms=200.0)
    async with aiohttp.ClientSession() as session, session.post(
            f"{fleet.router_url}/v1/chat/completions",
            json={**CHAT, "stream": True, "max_tokens": 40}) as streaming:
        assert streaming.status == 200
        await streaming.content.readline()
        started = time.monotonic()
        await fleet.runner.cleanup()
        stopped_s = time.monotonic() - started
        with pytest.raises(aiohttp.ClientPayloadError):
            await streaming.read()
    assert 0.5 <= stopped_s < 5, stopped_s
    assert "1 connection(s) still open after 0.5 s, cut now (serving: /v1/chat/completions)" \
        in caplog.text


async def test_affinity_holds_while_the_first_request_is_still_streaming(
        fleet_factory: FleetFactory) -> None:
    """A request is remembered for affinity when it is sent: others sharing its long prefix
    (or its session) that arrive while it streams go to the worker that has it cached."""
    fleet = await fleet_factory({"a": "us-east", "b": "us-east"}, decode_step_ms=40.0)
    system = {"role": "system", "content": "You are a careful assistant. " * 50}  # a prefix key
    first = {**CHAT, "stream": True, "max_tokens": 40,
             "messages": [system, {"role": "user", "content": "first question"}]}
    async with aiohttp.ClientSession() as session, session.post(
            f"{fleet.router_url}/v1/chat/completions", json=first,
            headers={"x-globalpool-session-id": "s-1"}) as streaming:
        assert streaming.status == 200
        worker = streaming.headers["x-globalpool-worker"]
        await streaming.content.readline()  # the first token: it is being served
        for body, headers in (
                ({**first, "messages": [system, {"role": "user", "content": "another user"}]},
                 {}),
                ({**first, "max_tokens": 4}, {"x-globalpool-session-id": "s-1"})):
            async with session.post(f"{fleet.router_url}/v1/chat/completions",
                                    json={**body, "stream": False, "max_tokens": 4},
                                    headers=headers) as response:
                assert response.status == 200
                assert response.headers["x-globalpool-route"] == "affinity"
                assert response.headers["x-globalpool-worker"] == worker
        assert not streaming.content.at_eof()  # all of that while the first one streamed
