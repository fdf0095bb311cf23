"""A hung worker is found within 5 s with the default settings, streaming or not, and what
waited on it is served elsewhere; a long legitimate generation is never cut. A wedged
engine (it takes requests in and counts them, /health and /metrics answer, and it runs no
step: a hung accelerator) is found by its agent within `heartbeat.stuck_after_s`, and the
router retries what waits there elsewhere and sends it nothing new until it steps again.

Runs `globalpool up` as a user would (real router, agents, simulators and Valkey), with the
router's timeouts and health settings left at their defaults: `total_s` is 900 s, so a
non-streaming request on a hung worker is rescued only if the router finds the hang
itself (its agent's heartbeats count none of the requests sent there). The agents are
told `heartbeat.stuck_after_s: 2` (15 s by default). Before they said so, a
non-streaming request on a wedged engine waited for `total_s`: the engine counts it as
running, as it counts a long generation, so no stall rule of the router's own could
tell it from one.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
import yaml

from lab.devstack.valkey import free_port
from tests.integration.operators_fleet import admin, scrape, value
from tests.integration.stack import RunningUp, pid_alive, start_up

pytestmark = pytest.mark.integration

BODY = {"model": "tiny-llama", "max_tokens": 8,
        "messages": [{"role": "user", "content": "ping"}]}
FROM_US_EAST = {"x-globalpool-client-region": "us-east"}
ADMIN_TOKEN = "hung-workers-admin-token"
STUCK_AFTER_S = 2.0


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningUp]:
    tmp_path = tmp_path_factory.mktemp("hung")
    simulated = {"max_num_seqs": 4, "decode_step_ms": 5}
    config = tmp_path / "regions.yaml"
    config.write_text(yaml.safe_dump({
        "apiVersion": "globalpool/v1",
        "redis": {"url": "embedded", "key_prefix": f"gp-{tmp_path.name[-12:]}"},
        # No timeouts or stall settings: the defaults (total_s 900 s). Only the ejection's
        # backoff is capped, so that the worker each test ejects is back for the next
        # (doubling from 1 s, the sixth ejection in a row would keep it out 30 s), and
        # the agents find a wedged engine in 2 s rather than 15.
        "heartbeat": {"stuck_after_s": STUCK_AFTER_S},
        "router": {"region": "us-east", "host": "127.0.0.1", "port": free_port(),
                   "health": {"max_backoff_s": 2.0}},
        "admin": {"token_env": "GP_TEST_ADMIN_TOKEN"},
        "regions": {
            "us-east": {"rtt_ms": {"eu-west": 80}, "models": ["tiny-llama"],
                        "simulated": {"workers": 2, **simulated}},
            "eu-west": {"models": ["tiny-llama"], "simulated": {"workers": 1, **simulated}},
        },
    }))
    os.environ["GP_TEST_ADMIN_TOKEN"] = ADMIN_TOKEN  # `up`'s children inherit it
    running = start_up(tmp_path, config)
    try:
        yield running
    finally:
        assert running.stop() == 0, running.output()
        assert [pid for pid in running.all_pids() if pid_alive(pid)] == []


def _sim_url(up: RunningUp, name: str) -> str:
    return next(str(c["url"]) for c in up.children() if c["name"] == name)


async def _faults(up: RunningUp, name: str, **knobs: object) -> None:
    async with aiohttp.ClientSession() as session, session.post(
            f"{_sim_url(up, name)}/sim/faults", json=knobs) as response:
        assert response.status == 200, await response.text()


async def _send(session: aiohttp.ClientSession, url: str, body: dict[str, Any]
                ) -> tuple[int, str, float, bytes]:
    started = time.monotonic()
    async with session.post(f"{url}/v1/chat/completions", json=body,
                            headers=FROM_US_EAST) as response:
        payload = await response.read()
        return (response.status, response.headers.get("x-globalpool-worker", ""),
                time.monotonic() - started, payload)


async def _status(up: RunningUp) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session, session.get(
            f"{up.url}/admin/status?workers=50",
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as response:
        assert response.status == 200, await response.text()
        status: dict[str, Any] = await response.json()
        return status


def _worker(status: dict[str, Any], worker_id: str) -> dict[str, Any]:
    return next(w for w in status["workers"] if w["id"] == worker_id)


async def _events(up: RunningUp) -> list[dict[str, Any]]:
    return list((await _status(up))["events"])  # newest first


async def _wait_until_served_by(up: RunningUp, worker: str, limit_s: float = 30.0) -> None:
    """Until `worker` serves a request again (its breaker has let it back in)."""
    deadline = time.monotonic() + limit_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            results = await asyncio.gather(*(_send(session, up.url, BODY) for _ in range(4)))
            if any(served == worker for _, served, _, _ in results):
                return
            await asyncio.sleep(0.5)
    raise AssertionError(f"{worker} never served again within {limit_s} s")


# The engine hangs (requests never reach it), or the engine serves each request while its
# answer goes wrong on the way (the simulator's misbehave knob): no answer at all, or the
# head and then nothing.
FAULTS: dict[str, dict[str, object]] = {"engine hang": {"hang": True},
          "no answer": {"misbehave": "no_answer"},
          "head, then nothing": {"misbehave": "headers_then_hang"}}
CLEAR: dict[str, object] = {"hang": False, "misbehave": "none"}


@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
async def test_a_hung_worker_is_found_within_5_s_and_its_requests_served_elsewhere(
        up: RunningUp, stream: bool, fault: str) -> None:
    await _faults(up, "sim-us-east-1", **FAULTS[fault])
    try:
        async with aiohttp.ClientSession() as session:
            async with asyncio.timeout(60):
                results = await asyncio.gather(
                    *(_send(session, up.url, {**BODY, "stream": stream}) for _ in range(8)))
        statuses = [status for status, _, _, _ in results]
        assert statuses == [200] * 8, results
        assert {worker for _, worker, _, _ in results} <= {"us-east-2", "eu-west-1"}
        slowest_s = max(elapsed for _, _, elapsed, _ in results)
        kind = "streaming" if stream else "non-streaming"
        print(f"hung worker ({fault}), {kind}: the slowest of 8 requests was served in "
              f"{slowest_s:.2f} s")
        # Found within stall_after_s (3 s) of waiting, checked every 0.25 s, plus the
        # retry; the bound is the 5 s, with room for the heartbeat that shows it.
        assert slowest_s < 5.0 + 1.0, sorted(round(e, 2) for _, _, e, _ in results)
        ejected = [e for e in await _events(up)
                   if e["subject"].startswith("worker us-east-1 ") and e["kind"] == "ejected"]
        assert ejected and "stalled" in ejected[0]["detail"], ejected
    finally:
        await _faults(up, "sim-us-east-1", **CLEAR)
    await _wait_until_served_by(up, "us-east-1")


# ~1,000 tokens at 5 ms x 2 a step: ~10 s of generation, past stall_after_s three times
# over, on engines that count the request as running all along; and 14 tokens at ~0.55 s
# a step (a hundred times slower): ~8 s held, each step under the agents' stuck_after_s.
@pytest.mark.parametrize(("slow_factor", "max_tokens"), [(2.0, 1000), (100.0, 14)],
                         ids=["many fast steps", "few slow steps"])
async def test_a_long_non_streaming_generation_is_never_cut(
        up: RunningUp, slow_factor: float, max_tokens: int) -> None:
    await _wait_until_served_by(up, "us-east-1")
    for name in ("sim-us-east-1", "sim-us-east-2"):
        await _faults(up, name, slow_factor=slow_factor)
    started_unix_s = time.time()
    try:
        async with aiohttp.ClientSession() as session:
            async with asyncio.timeout(60):
                status, worker, elapsed_s, payload = await _send(
                    session, up.url, {**BODY, "max_tokens": max_tokens, "ignore_eos": True})
    finally:
        for name in ("sim-us-east-1", "sim-us-east-2"):
            await _faults(up, name, slow_factor=1.0)
    assert status == 200, payload
    assert worker.startswith("us-east-"), worker
    assert elapsed_s > 6.0, elapsed_s  # it did run long
    status_now = await _status(up)
    new_events = [e for e in status_now["events"] if e["at_unix_s"] >= started_unix_s]
    assert not [e for e in new_events if e["kind"] == "ejected"], new_events
    assert _worker(status_now, worker)["state"] == "ready"  # not taken for a stuck engine


async def test_a_whole_answer_whose_body_never_ends_is_served_elsewhere(up: RunningUp) -> None:
    # The engine generates the answer; the body on its way never ends (a chunk every
    # 10 ms, for ever): not silence, but no engine writes a whole answer that way.
    await _faults(up, "sim-us-east-1", misbehave="endless_body")
    try:
        async with aiohttp.ClientSession() as session:
            async with asyncio.timeout(60):
                results = await asyncio.gather(
                    *(_send(session, up.url, BODY) for _ in range(8)))
    finally:
        await _faults(up, "sim-us-east-1", **CLEAR)
    assert [status for status, _, _, _ in results] == [200] * 8, results
    assert {worker for _, worker, _, _ in results} <= {"us-east-2", "eu-west-1"}
    slowest_s = max(elapsed for _, _, elapsed, _ in results)
    print(f"endless body, non-streaming: the slowest of 8 requests was served in "
          f"{slowest_s:.2f} s")
    assert slowest_s < 5.0 + 1.0
    await _wait_until_served_by(up, "us-east-1")


OTHERS = ({"worker": "us-east-2"}, {"region": "eu-west"})


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
async def test_a_stalled_worker_keeps_what_could_go_nowhere_else_and_serves_it_when_back(
        up: RunningUp, stream: bool) -> None:
    # The engine stops counting and answering its requests for 6 s, then comes back (a
    # host that starves it of CPU, a SIGSTOP): found stalled after 3 s and ejected, but
    # every other worker is drained, so that nothing else could take its four requests.
    # They wait there, and are served when it is back, instead of failing with a 504.
    for drained in OTHERS:
        assert (await admin(up.url, "POST", "/admin/drain", token=ADMIN_TOKEN,
                            body=drained))[0] == 200
    started_unix_s = time.time()
    await _faults(up, "sim-us-east-1", hang=True)
    try:
        async with aiohttp.ClientSession() as session:
            sending = asyncio.gather(
                *(_send(session, up.url, {**BODY, "stream": stream}) for _ in range(4)))
            await asyncio.sleep(6.0)
            await _faults(up, "sim-us-east-1", hang=False)
            async with asyncio.timeout(30):
                results = await sending
    finally:
        await _faults(up, "sim-us-east-1", **CLEAR)
        for drained in OTHERS:
            assert (await admin(up.url, "POST", "/admin/undrain", token=ADMIN_TOKEN,
                                body=drained))[0] == 200
    assert [status for status, _, _, _ in results] == [200] * 4, results
    assert {worker for _, worker, _, _ in results} == {"us-east-1"}
    assert min(elapsed for _, _, elapsed, _ in results) > 5.5  # they did wait it out
    ejected = [e for e in await _events(up) if e["at_unix_s"] >= started_unix_s
               and e["subject"].startswith("worker us-east-1 ") and e["kind"] == "ejected"]
    assert ejected and all("stalled" in e["detail"] for e in ejected), ejected
    assert "4 kept waiting there: no other worker can take them" in ejected[-1]["detail"]
    await _wait_until_served_by(up, "us-east-1")


# --- a wedged engine -------------------------------------------------------------------


async def _until(check: Any, limit_s: float, what: str) -> float:
    """Poll `check` (async, truthy when done) every 0.1 s; the seconds it took."""
    started = time.monotonic()
    while time.monotonic() - started < limit_s:
        if await check():
            return time.monotonic() - started
        await asyncio.sleep(0.1)
    raise AssertionError(f"{what}: not within {limit_s} s")


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
async def test_what_waits_on_a_wedged_engine_is_served_elsewhere_and_it_gets_nothing_new(
        up: RunningUp, stream: bool) -> None:
    started_unix_s = time.time()
    await _faults(up, "sim-us-east-1", wedge=True)
    try:
        async with aiohttp.ClientSession() as session:
            sending = asyncio.gather(
                *(_send(session, up.url, {**BODY, "stream": stream}) for _ in range(8)))

            async def said_stuck() -> bool:
                worker = _worker(await _status(up), "us-east-1")
                return bool(worker["state"] == "degraded" and worker["engine"]["stuck_for_s"])
            said_after_s = await _until(said_stuck, 15.0, "the agent saying stuck")
            async with session.get(f"{up.url}/metrics") as response:
                exposition = await response.text()
            assert 'globalpool_workers_engine_stuck{region="us-east"} 1.0' in exposition
            async with asyncio.timeout(60):
                results = await sending
            # Nothing new goes there while it is stuck.
            later = await asyncio.gather(*(_send(session, up.url, BODY) for _ in range(8)))
    finally:
        await _faults(up, "sim-us-east-1", wedge=False)
    statuses = [status for status, _, _, _ in results + later]
    assert statuses == [200] * 16, results + later
    assert {worker for _, worker, _, _ in results + later} <= {"us-east-2", "eu-west-1"}
    slowest_s = max(elapsed for _, _, elapsed, _ in results)
    kind = "streaming" if stream else "non-streaming"
    print(f"wedged engine, {kind}: its agent said so {said_after_s:.1f} s after the first "
          f"request; the slowest of 8 requests was served in {slowest_s:.2f} s")
    # The agent's verdict (2 s, and a heartbeat), the router's stall_after_s (3 s) of
    # waiting and its check (0.25 s), then the retry; not timeouts.total_s (900 s).
    assert slowest_s < 3.0 + 2.0 + 1.0, sorted(round(e, 2) for _, _, e, _ in results)
    events = [e for e in (await _status(up))["events"] if e["at_unix_s"] >= started_unix_s
              and e["subject"].startswith("worker us-east-1 ") and e["kind"] == "ejected"]
    assert events, "us-east-1 was never ejected"
    details = " | ".join(e["detail"] for e in events)
    assert "its engine has run no step for" in details, details  # the heartbeat's word
    if not stream:  # (a stream's first byte overdue while others answer may show first)
        assert "agent reports no engine step" in details, details
    await _wait_until_served_by(up, "us-east-1")
    assert _worker(await _status(up), "us-east-1")["engine"]["stuck_for_s"] is None


async def test_a_stream_under_way_when_its_engine_wedges_goes_on_elsewhere(up: RunningUp
                                                                          ) -> None:
    # 600 tokens at ~5.5 ms a step (~3.3 s); its engine wedges after 20. Its agent says
    # so in 2 s, and once the stream has been silent for stall_after_s (3 s) the router
    # cuts it and continues it on another worker (mid-stream failover), where it used to
    # wait timeouts.idle_s (60 s) for a chunk. The client sees one whole stream.
    await _wait_until_served_by(up, "us-east-1")
    continued_before = value(await scrape(up.url), "globalpool_stream_failovers_total",
                             outcome="continued")
    body = {**BODY, "stream": True, "max_tokens": 600, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    events: list[dict[str, Any]] = []
    done = 0
    wedged: str | None = None
    started_unix_s = time.time()
    try:
        async with aiohttp.ClientSession() as session, session.post(
                f"{up.url}/v1/chat/completions", json=body, headers=FROM_US_EAST) as response:
            assert response.status == 200
            worker = response.headers["x-globalpool-worker"]
            async for line in response.content:
                if not line.startswith(b"data: "):
                    continue
                if line.strip() == b"data: [DONE]":
                    done += 1
                    continue
                events.append(json.loads(line[6:]))
                if wedged is None and len(events) == 20:
                    wedged = f"sim-{worker}"
                    await _faults(up, wedged, wedge=True)
                    wedged_at = time.monotonic()
            ended_after_s = time.monotonic() - wedged_at
    finally:
        if wedged is not None:
            await _faults(up, wedged, wedge=False)
    assert wedged is not None, events
    print(f"a stream whose engine wedged after 20 tokens ended {ended_after_s:.1f} s later")
    assert done == 1
    assert {event["id"] for event in events} == {events[0]["id"]}
    finished = [choice["finish_reason"] for event in events for choice in event["choices"]
                if choice.get("finish_reason")]
    assert finished == ["length"], finished
    assert events[-1]["usage"]["completion_tokens"] == 600, events[-1]
    assert ended_after_s < 15.0  # stuck_after_s + stall_after_s + the rest, not idle_s
    cut = [e for e in (await _status(up))["events"] if e["at_unix_s"] >= started_unix_s
           and e["kind"] == "streams cut"]
    assert [e["subject"].split()[1] for e in cut] == [worker], cut
    assert value(await scrape(up.url), "globalpool_stream_failovers_total",
                 outcome="continued") == continued_before + 1
    await _wait_until_served_by(up, worker)
