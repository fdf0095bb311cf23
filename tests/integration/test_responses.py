"""The Responses API through routers in two regions: real router apps sharing a real Valkey,
in front of real simulators that store responses in their own memory as vLLM does.

A conversation started through one region's replica continues, is retrieved and is
cancelled through the other's, at the worker that holds it; what cannot be found is
OpenAI's 404, counted by why, and never served by another worker."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI

from lab.sim.server import SimServer
from router.app import RESPONSE_STORE
from tests.integration.operators_fleet import OpsFleet, fleet_config, scrape, value
from worker.heartbeat_keys import HeartbeatKeys
from worker.publisher import HeartbeatPublisher
from worker.redis_client import connect

pytestmark = pytest.mark.integration

# Two workers in us-east, one in eu-west; one replica in each region.
WORKERS = {"a": "us-east", "b": "us-east", "c": "eu-west"}
REGIONS = ("us-east", "eu-west")


async def started(fleet: OpsFleet, **config: Any) -> OpsFleet:
    await fleet.start(WORKERS, replicas=2, replica_regions=REGIONS,
                      config=fleet_config(fleet.redis_url, fleet.key_prefix, **config))
    return fleet


def client(url: str, key: str = "unused") -> AsyncOpenAI:
    return AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


async def create(url: str, body: dict[str, Any], key: str | None = None
                 ) -> tuple[int, dict[str, Any], str]:
    """POST /v1/responses: status, JSON answer, the worker that served it."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as session, session.post(
            url + "/v1/responses", json=body, headers=headers) as response:
        return (response.status, await response.json(content_type=None),
                response.headers.get("x-globalpool-worker", ""))


async def get(url: str, path: str, key: str | None = None,
              method: str = "GET") -> tuple[int, dict[str, Any], str]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as session, session.request(
            method, url + path, headers=headers) as response:
        return (response.status, await response.json(content_type=None),
                response.headers.get("x-globalpool-worker", ""))


def is_unknown(answer: dict[str, Any], response_id: str) -> bool:
    error = answer.get("error") or {}
    return (error.get("type") == "invalid_request_error"
            and f"'{response_id}' not found" in error.get("message", ""))


async def test_a_conversation_continues_at_its_worker_through_the_other_regions_replica(
        fleet: OpsFleet) -> None:
    await started(fleet)
    east, west = fleet.urls
    async with client(east) as from_east, client(west) as from_west:
        for turn in range(6):
            first = await from_east.responses.with_raw_response.create(
                model="m", input=f"hello {turn}", max_output_tokens=4)
            holder = first.headers["x-globalpool-worker"]
            answer = first.parse()
            # (vLLM: "incomplete" when max_output_tokens cut it, as here)
            assert answer.id.startswith("resp_") and answer.status in ("completed", "incomplete")
            # eu-west's replica would send a new conversation to its own worker "c"
            follow = await from_west.responses.with_raw_response.create(
                model="m", input="and then?", previous_response_id=answer.id,
                max_output_tokens=4)
            assert follow.headers["x-globalpool-worker"] == holder
            assert follow.headers["x-globalpool-route"] != "retry"
            again = await from_west.responses.retrieve(answer.id)
            assert (again.id, again.output_text) == (answer.id, answer.output_text)
            # the follow-up is stored too, and found from the first region
            second = follow.parse()
            assert (await from_east.responses.retrieve(second.id)).id == second.id
    samples = await scrape(west)
    assert value(samples, "globalpool_response_lookups_total", outcome="found") == 12
    assert value(samples, "globalpool_requests_total", kind="responses") == 6


async def test_a_streamed_answer_is_recorded_as_it_starts(fleet: OpsFleet) -> None:
    await started(fleet)
    east, west = fleet.urls
    async with client(east) as from_east, client(west) as from_west:
        stream = await from_east.responses.create(model="m", input="stream it",
                                                  max_output_tokens=8, stream=True)
        kinds = []
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.created":
                created_id = event.response.id
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        # (the engine stores a response once it is finished, as vLLM does)
        assert (await from_west.responses.retrieve(created_id)).id == created_id
        follow = await from_west.responses.with_raw_response.create(
            model="m", input="more", previous_response_id=created_id, max_output_tokens=2)
        assert follow.parse().status in ("completed", "incomplete")
        # each replica recorded the response it passed on: the stream, the follow-up
        assert [app[RESPONSE_STORE].stats.recorded["stored"] for app in fleet.apps] == [1, 1]


async def test_what_cannot_be_found_is_openais_404_and_never_served_elsewhere(
        fleet: OpsFleet) -> None:
    await started(fleet)
    east, west = fleet.urls
    status, answer, _ = await get(west, "/v1/responses/resp_0000nothing")
    assert status == 404 and is_unknown(answer, "resp_0000nothing")
    status, answer, _ = await get(west, "/v1/responses/resp_0000nothing/cancel", method="POST")
    assert status == 404
    status, answer, worker = await create(west, {"model": "m", "input": "x",
                                                 "previous_response_id": "resp_0000nothing"})
    assert (status, worker) == (404, "")
    assert answer["error"]["code"] == "previous_response_not_found"
    assert answer["error"]["param"] == "previous_response_id"
    for hostile in ("resp_%0d%0aSET", "x" * 300, "..%2f..%2fmetrics"):
        status, answer, _ = await get(west, f"/v1/responses/{hostile}")
        assert status == 404 and "127.0.0.1" not in json.dumps(answer)
    # store: false is kept by no one
    status, answer, _ = await create(east, {"model": "m", "input": "x", "store": False,
                                            "max_output_tokens": 2})
    assert status == 200
    status, missing, _ = await get(west, f"/v1/responses/{answer['id']}")
    assert status == 404 and is_unknown(missing, answer["id"])
    samples = await scrape(west)
    assert value(samples, "globalpool_response_lookups_total", outcome="unknown") >= 4


async def test_a_conversation_whose_worker_is_gone_or_forgot_it_is_404_and_counted(
        fleet: OpsFleet) -> None:
    await started(fleet)
    east, west = fleet.urls
    ids: dict[str, str] = {}
    for number in range(12):  # one conversation on each worker at least
        status, answer, worker = await create(east, {"model": "m", "input": f"n{number}",
                                                     "max_output_tokens": 2})
        assert status == 200
        ids.setdefault(worker, answer["id"])
        if len(ids) == 2:
            break
    gone, forgetful = sorted(ids)[:2]
    publisher = HeartbeatPublisher(connect(fleet.redis_url), HeartbeatKeys(fleet.key_prefix))
    await publisher.remove(gone)  # the worker left the fleet (its agent stopped)
    await publisher.aclose()
    restarted = fleet.sims[forgetful]  # its engine restarted: its memory is empty
    port = int(restarted.url.rsplit(":", 1)[1])
    await restarted.stop()
    fleet.sims[forgetful] = SimServer(restarted.config, port=port)
    await fleet.sims[forgetful].start()
    await _until_gone(fleet, gone)
    for url in (east, west):
        for holder, response_id in ids.items():
            status, answer, worker = await create(url, {
                "model": "m", "input": "x", "previous_response_id": response_id})
            # gone: refused at the router; forgot: its engine's own 404, passed on
            assert (status, worker) == (404, "" if holder == gone else holder), answer
            assert is_unknown(answer, response_id)
            status, answer, _ = await get(url, f"/v1/responses/{response_id}")
            assert status == 404 and is_unknown(answer, response_id)
    samples = await scrape(west)
    # on this replica: the gone worker's follow-up and GET
    assert value(samples, "globalpool_response_lookups_total", outcome="worker_gone") == 2
    assert value(samples, "globalpool_response_lookups_total", outcome="worker_forgot") == 1


async def _until_gone(fleet: OpsFleet, worker_id: str) -> None:
    from router.app import HOLDER
    from tests.integration.operators_fleet import wait_for
    await wait_for(lambda: all(worker_id not in app[HOLDER].current.workers
                               for app in fleet.apps))


TENANT_KEYS = {"acme": "sk-acme-0123456789abcdef", "globex": "sk-globex-0123456789abcdef"}


async def test_a_response_is_found_only_by_its_tenant(fleet: OpsFleet) -> None:
    config = fleet_config(fleet.redis_url, fleet.key_prefix)
    config["auth"] = {
        "tenants": {"acme": {}, "globex": {"allowed_regions": ["eu-west"]}},
        "keys": [{"id": f"{tenant}-key", "tenant": tenant,
                  "sha256": hashlib.sha256(key.encode()).hexdigest()}
                 for tenant, key in TENANT_KEYS.items()]}
    await fleet.start(WORKERS, replicas=2, replica_regions=REGIONS, config=config)
    east, west = fleet.urls
    acme, globex = TENANT_KEYS["acme"], TENANT_KEYS["globex"]
    status, answer, _ = await create(east, {"model": "m", "input": "mine",
                                            "max_output_tokens": 2}, acme)
    assert status == 200
    path = f"/v1/responses/{answer['id']}"
    assert (await get(west, path))[0] == 401
    status, other, _ = await get(west, path, globex)
    assert status == 404 and is_unknown(other, answer["id"])  # not "forbidden": not there
    status, other, _ = await create(west, {"model": "m", "input": "x",
                                           "previous_response_id": answer["id"]}, globex)
    assert status == 404 and other["error"]["code"] == "previous_response_not_found"
    status, mine, _ = await get(west, path, acme)
    assert (status, mine["id"]) == (200, answer["id"])
    # globex may use eu-west only: its conversation is created and continued there
    status, theirs, worker = await create(east, {"model": "m", "input": "theirs",
                                                 "max_output_tokens": 2}, globex)
    assert (status, worker) == (200, "c")
    status, _, worker = await create(east, {"model": "m", "input": "x", "max_output_tokens": 2,
                                            "previous_response_id": theirs["id"]}, globex)
    assert (status, worker) == (200, "c")
    samples = await scrape(west)
    assert value(samples, "globalpool_response_lookups_total", outcome="other_tenant") == 2
