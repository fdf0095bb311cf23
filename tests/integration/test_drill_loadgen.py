"""The drills' load generator against a real simulator (and a tiny SSE server) on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from lab.devstack.loadgen import LoadGenerator, LoadSpec, LoadTarget
from tests.integration.conftest import StartSim

pytestmark = pytest.mark.integration


async def _faults(url: str, **knobs: object) -> None:
    async with aiohttp.ClientSession() as session, session.post(
        f"{url}/sim/faults", json=knobs
    ) as response:
        assert response.status == 200


def _spec(url: str, **changes: object) -> LoadSpec:
    settings: dict[str, object] = {"duration_s": 1.0, "rate_per_s": 40.0, "max_requests": 12,
                                   "max_tokens": 5, "request_timeout_s": 5.0, "model": "m"}
    settings.update(changes)
    return LoadSpec(targets=[LoadTarget(url, origin_region="us-east")], **settings)  # type: ignore[arg-type]


async def test_records_each_request(start_sim: StartSim) -> None:
    sim = await start_sim(served_model_names=("m",))
    results = await LoadGenerator(_spec(sim.url)).run()
    assert len(results) == 12
    for result in results:
        assert result.ok and result.status == 200 and result.tokens == 5, result
        assert result.first_byte_s is not None and result.first_token_s is not None
        assert result.start_s <= result.first_byte_s <= result.first_token_s <= result.end_s
        assert result.origin_region == "us-east"


async def test_classifies_failures_by_phase(start_sim: StartSim) -> None:
    sim = await start_sim(served_model_names=("m",))
    await _faults(sim.url, error_rate=1.0)
    refused = await LoadGenerator(_spec(sim.url, max_requests=4)).run()
    assert {(r.status, r.failure) for r in refused} == {(500, "before_first_byte")}
    await _faults(sim.url, error_rate=0.0, mid_stream_error_rate=1.0)
    cut = await LoadGenerator(_spec(sim.url, max_requests=4, max_tokens=20)).run()
    assert {r.failure for r in cut} == {"mid_stream"}
    assert all(r.first_byte_s is not None for r in cut)


@pytest.fixture
async def error_event_server() -> AsyncIterator[str]:
    """Answers like the router when a stream breaks: a token, an error event, [DONE]."""
    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "x-globalpool-region": "eu-west",
                                               "x-globalpool-worker": "eu-west-1",
                                               "server-timing": "route;dur=0.1, retry;dur=3"})
        await response.prepare(request)
        await response.write(b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n')
        await response.write(b'\n\ndata: {"error": {"message": "the worker\'s stream broke '
                             b'off"}}\n\ndata: [DONE]\n\n')
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", stream)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    await runner.cleanup()


async def test_an_sse_error_event_is_a_mid_stream_failure(error_event_server: str) -> None:
    results = await LoadGenerator(_spec(error_event_server, max_requests=2)).run()
    for result in results:
        assert result.failure == "mid_stream" and "broke off" in (result.error or "")
        assert (result.region, result.worker, result.retried) == ("eu-west", "eu-west-1", True)
        assert result.tokens == 1


async def test_is_bounded_in_count_and_time(start_sim: StartSim) -> None:
    sim = await start_sim(served_model_names=("m",))
    loop = asyncio.get_running_loop()
    started = loop.time()
    results = await LoadGenerator(_spec(sim.url, rate_per_s=1000.0, max_requests=30)).run()
    assert len(results) == 30
    closed = await LoadGenerator(_spec(sim.url, rate_per_s=None, concurrency=3,
                                       max_requests=9)).run()
    assert len(closed) == 9
    timed = await LoadGenerator(_spec(sim.url, rate_per_s=None, concurrency=2,
                                      duration_s=0.3, max_requests=10_000)).run()
    assert 0 < len(timed) < 10_000
    assert loop.time() - started < 10
    with pytest.raises(ValueError, match="exactly one"):
        _spec(sim.url, concurrency=2)
