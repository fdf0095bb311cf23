"""A worker whose heartbeat lists a model it no longer serves (an adapter unloaded, the
engine restarted with another model, and its agent's next heartbeat not out yet): vLLM
answers 404 "The model `X` does not exist.", and the request is served by another worker
of the model rather than passed on as a 404.

Real simulators and a real router on loopback (the fleet of test_proxy); the simulator's
`unserved` knob plays the moment before the heartbeat catches up, for as long as a test
needs it.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from router.app import HOLDER
from tests.integration.operators_fleet import scrape, value
from tests.integration.test_proxy import CHAT, Fleet, FleetFactory, fleet_factory

__all__ = ["fleet_factory"]
pytestmark = pytest.mark.integration

FROM_US_EAST = {"x-globalpool-client-region": "us-east"}


async def _chat(url: str, **fields: object) -> tuple[int, dict[str, str], dict[str, object]]:
    async with aiohttp.ClientSession() as session, session.post(
            f"{url}/v1/chat/completions", json={**CHAT, **fields},
            headers=FROM_US_EAST) as response:
        return response.status, dict(response.headers), await response.json()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_model_the_worker_no_longer_serves_is_served_by_another(
        fleet_factory: FleetFactory, stream: bool) -> None:
    fleet = await fleet_factory({"a": "us-east", "b": "eu-west"})
    await fleet.faults("a", unserved=True)  # us-east's, the nearest: tried first
    routes = []
    for _ in range(3):
        async with aiohttp.ClientSession() as session, session.post(
                f"{fleet.router_url}/v1/chat/completions", json={**CHAT, "stream": stream},
                headers=FROM_US_EAST) as response:
            body = await response.read()
            assert response.status == 200, body
            assert response.headers["x-globalpool-worker"] == "b"
            routes.append(response.headers["x-globalpool-route"])
    # Refused once: then kept from the model until its next heartbeat (the next two
    # went to eu-west at once, not after a refusal each).
    assert routes[0] == "retry" and "retry" not in routes[1:], routes
    samples = await scrape(fleet.router_url)
    assert value(samples, "globalpool_attempt_failures_total", failure="not_served") == 1
    # Not the worker's fault: it is not ejected, and serves again once it does (its
    # agent's next heartbeat says so).
    assert value(samples, "globalpool_ejections_total") == 0
    await fleet.faults("a", unserved=False)
    await _beat(fleet, "a")
    status, headers, _ = await _chat(fleet.router_url)
    assert status == 200 and headers["x-globalpool-worker"] == "a"


async def test_a_worker_that_keeps_saying_so_costs_one_attempt_per_heartbeat(
        fleet_factory: FleetFactory) -> None:
    # A lying or broken worker: its heartbeats go on listing the model, its engine goes
    # on refusing it. Each of its heartbeats buys it one refused attempt, not one for
    # every request routed its way.
    fleet = await fleet_factory({"a": "us-east", "b": "eu-west"})
    await fleet.faults("a", unserved=True)
    for beat in range(4):
        for _ in range(5):
            status, headers, _ = await _chat(fleet.router_url)
            assert status == 200 and headers["x-globalpool-worker"] == "b"
        await _beat(fleet, "a")
        samples = await scrape(fleet.router_url)
        assert value(samples, "globalpool_attempt_failures_total",
                     failure="not_served") == beat + 1
    assert value(samples, "globalpool_ejections_total") == 0


async def _beat(fleet: Fleet, worker_id: str) -> None:
    """A heartbeat of the worker (as its agent's next one), once the router has it."""
    holder = fleet.runner.app[HOLDER]
    seq = holder.current.workers[worker_id].seq
    await fleet.publish(worker_id)
    deadline = time.monotonic() + 5
    while holder.current.workers[worker_id].seq == seq:
        assert time.monotonic() < deadline, "the router never saw the heartbeat"
        await asyncio.sleep(0.01)


async def test_when_no_worker_serves_it_the_client_gets_the_engines_404(
        fleet_factory: FleetFactory) -> None:
    fleet = await fleet_factory({"a": "us-east", "b": "eu-west"})
    await fleet.faults("a", unserved=True)
    await fleet.faults("b", unserved=True)
    status, headers, answer = await _chat(fleet.router_url)
    assert status == 404, answer
    assert headers["Content-Type"].startswith("application/json")
    error = answer["error"]
    assert isinstance(error, dict) and error["message"] == "The model `m` does not exist."
    samples = await scrape(fleet.router_url)
    assert value(samples, "globalpool_attempt_failures_total", failure="not_served") == 2
    assert value(samples, "globalpool_retry_budget_denied_total") == 0
    # Both refused it: neither is kept away (no 503 "no worker"); each is asked again.
    status, _, answer = await _chat(fleet.router_url)
    assert status == 404, answer
    samples = await scrape(fleet.router_url)
    assert value(samples, "globalpool_attempt_failures_total", failure="not_served") == 4
