"""An attacker with write access to the router's Redis: what test_redis_attacker.py did not
reach. Rate-limit buckets, the Responses API's signed records, and a flood of peer reports
(unsigned mode) or a signed report's `affinity` claims.

Real router apps in front of real simulators (tests.integration.operators_fleet), a real
Valkey written with redis-py as the attacker would; nothing of the project mocked. Every
loop is bounded in count and time.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

import aiohttp
import pytest

from router.app import PROXY
from router.auth.keys import hash_key
from router.core.parse import prefix_keys_of
from router.proxy.replies import ROUTE_HEADER, WORKER_HEADER
from router.registry.peer_reports import encode_report
from router.registry.shared_sends import SharedSends
from tests.integration.operators_fleet import (
    CHAT,
    OpsFleet,
    admin,
    chat,
    fleet_config,
    scrape,
    value,
)
from tests.integration.test_batches import KEYS, config
from tests.integration.test_redis_attacker import SIGNING_KEYS, attacker, crashes, signed
from tests.integration.test_responses import create, get, is_unknown

pytestmark = pytest.mark.integration


# --- rate-limit buckets --------------------------------------------------------------------

def limited(fleet: OpsFleet, tenants: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A fleet config with one key per tenant (`gp-rl-<tenant>`), each tenant's limits."""
    document = fleet_config(fleet.redis_url, fleet.key_prefix)
    document["auth"] = {
        "tenants": {tenant: {"limits": limits} for tenant, limits in tenants.items()},
        "keys": [{"id": f"{tenant}-key", "tenant": tenant,
                  "sha256": hash_key(f"gp-rl-{tenant}")} for tenant in tenants],
        # generous: the machine may be busy; the fallback is not what is measured here
        "rate_limits": {"redis_timeout_ms": 1000},
    }
    return document


def bucket(fleet: OpsFleet, tenant: str) -> str:
    """The Redis key of a tenant's requests bucket (router.admission.redis_limiter)."""
    return f"{fleet.key_prefix}:rl:{{{tenant}}}:tenant:requests"


async def as_tenant(url: str, tenant: str) -> tuple[int, bytes]:
    status, _, body = await chat(url, CHAT, {"Authorization": f"Bearer gp-rl-{tenant}"})
    return status, body


def openai_error(body: bytes) -> dict[str, Any]:
    error = json.loads(body)["error"]
    assert isinstance(error, dict) and {"message", "type", "code"} <= set(error), error
    return error


# What an attacker writes into a bucket that should hold a time in microseconds.
POISON_STRINGS = {"negative": "-99999999999999", "minus_inf": "-inf", "nan": "nan",
                  "text": "not a number", "empty": ""}


async def test_absurd_bucket_values_neither_crash_nor_lift_the_limit(fleet: OpsFleet) -> None:
    """Each tenant (3 requests a minute) has its bucket overwritten before it asks: with
    a negative time, -inf, NaN, text, an empty string, and a hash where a string belongs.
    Ten requests each: never a 5xx, every refusal an OpenAI-format 429, and no tenant
    gets more than its burst (3). (Text, NaN, empty and the hash make the script fail:
    the replica falls back to its local limiter, see the next test.)"""
    tenants = [*POISON_STRINGS, "hash"]
    await fleet.start({"a": "us-east"}, config=limited(
        fleet, {t: {"requests_per_min": 3} for t in tenants}))
    async with attacker(fleet) as redis:
        for tenant, poison in POISON_STRINGS.items():
            await redis.set(bucket(fleet, tenant), poison)
        await redis.hset(bucket(fleet, "hash"), mapping={"tat": "1", "x": "y"})
    admitted: dict[str, int] = {}
    for tenant in tenants:
        for _ in range(10):
            status, body = await as_tenant(fleet.url, tenant)
            assert status in (200, 429), (tenant, status, body[:300])
            if status == 429:
                assert openai_error(body)["code"] == "rate_limit_exceeded", body[:300]
            else:
                admitted[tenant] = admitted.get(tenant, 0) + 1
    assert all(count <= 3 for count in admitted.values()), admitted
    assert admitted.get("negative") == 3 and admitted.get("minus_inf") == 3, admitted


async def test_a_poisoned_bucket_does_not_refuse_a_tenant_for_anothers_use(
        fleet: OpsFleet) -> None:
    """globex uses its 3 requests (through Redis). The attacker writes a hash where acme's
    bucket belongs: the script fails for acme (WRONGTYPE), so acme is decided by the
    replica's local limiter, on every request. acme has used nothing: it must be
    admitted."""
    await fleet.start({"a": "us-east"}, config=limited(
        fleet, {t: {"requests_per_min": 3} for t in ("acme", "globex")}))
    assert [(await as_tenant(fleet.url, "globex"))[0] for _ in range(3)] == [200] * 3
    async with attacker(fleet) as redis:
        await redis.hset(bucket(fleet, "acme"), mapping={"tat": "1"})
    status, body = await as_tenant(fleet.url, "acme")
    assert status in (200, 429), body[:300]
    assert status == 200, f"acme, which sent nothing before, was refused: {body[:300]!r}"


@pytest.mark.parametrize("poison", ["1e30", "inf"])
async def test_a_bucket_set_far_in_the_future_does_not_lock_a_tenant_out(
        fleet: OpsFleet, poison: str) -> None:
    """A bucket of one request with a 0.1 s refill (600 a minute, burst 1): whatever the
    attacker writes, a legitimate bucket is never more than one refill ahead, so the
    tenant must be admitted again within about that long."""
    await fleet.start({"a": "us-east"}, config=limited(
        fleet, {"acme": {"requests_per_min": 600, "burst_requests": 1}}))
    assert (await as_tenant(fleet.url, "acme"))[0] == 200
    async with attacker(fleet) as redis:
        await redis.set(bucket(fleet, "acme"), poison)  # no TTL, as an attacker writes it
    answers: list[tuple[int, bytes]] = []
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline and len(answers) < 30:
        answers.append(await as_tenant(fleet.url, "acme"))
        if answers[-1][0] == 200:
            break
        await asyncio.sleep(0.1)
    statuses = [status for status, _ in answers]
    assert all(status in (200, 429) for status in statuses), statuses
    for status, body in answers:
        if status == 429:
            openai_error(body)
    assert 200 in statuses, (
        f"tenant refused {len(statuses)} times over 3 s after its bucket was set to "
        f"{poison!r}; last: {answers[-1][1][:200]!r}")


# --- the Responses API's records -----------------------------------------------------------

RESPONSE_WORKERS = {"a": "us-east", "c": "eu-west"}
REPLICA_REGIONS = ("us-east", "eu-west")


async def responses_fleet(fleet: OpsFleet, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two replicas, one per region, records signed; tenants acme and other (KEYS)."""
    await fleet.start(RESPONSE_WORKERS, replicas=2, replica_regions=REPLICA_REGIONS,
                      config=signed(monkeypatch, config(fleet, keys=True)))


async def new_response(url: str, key: str) -> str:
    status, answer, _ = await create(url, {"model": "m", "input": "hello",
                                           "max_output_tokens": 2}, key)
    assert status == 200, answer
    response_id = answer["id"]
    assert isinstance(response_id, str)
    return response_id


async def test_signed_response_records_moved_or_reshaped_are_not_believed(
        fleet: OpsFleet, monkeypatch: pytest.MonkeyPatch) -> None:
    """The attacker copies acme's signed record over `other`'s response and under a new
    id; writes one of 10 MB, and ones of the wrong shape. Asked through the replica that
    did not record them (so Redis is read): each is OpenAI's 404, counted `forged`;
    untouched records are still found."""
    await responses_fleet(fleet, monkeypatch)
    east, west = fleet.urls
    acme_id = await new_response(east, KEYS["acme"])
    other_id = await new_response(east, KEYS["other"])
    spare_id = await new_response(east, KEYS["other"])
    prefix = f"{fleet.key_prefix}:response:"
    async with attacker(fleet) as redis:
        acme_record = await redis.get(prefix + acme_id)
        assert acme_record is not None and b'"s":' in acme_record  # signed
        await redis.set(prefix + other_id, acme_record)  # replay for another id
        await redis.set(prefix + "resp_forged0123456789", acme_record)  # a new id
        fields = json.loads(acme_record)
        await redis.set(prefix + "resp_forged_owner", json.dumps({**fields, "o": "other"}))
        await redis.set(prefix + "resp_forged_huge", b"{" + b" " * 10_000_000 + b"}")
        await redis.set(prefix + "resp_forged_types", json.dumps(
            {**fields, "w": ["a"], "r": 1, "o": {"x": 1}}))
        await redis.set(prefix + "resp_forged_list", json.dumps([fields]))
    cases = [(other_id, "other"), (other_id, "acme"), ("resp_forged0123456789", "acme"),
             ("resp_forged_owner", "other"), ("resp_forged_huge", "acme"),
             ("resp_forged_types", "acme"), ("resp_forged_list", "acme")]
    for response_id, tenant in cases:
        status, answer, worker = await get(west, f"/v1/responses/{response_id}", KEYS[tenant])
        assert status == 404 and is_unknown(answer, response_id), (
            response_id, tenant, status, answer, worker)
        assert worker == ""
    status, answer, _ = await get(west, f"/v1/responses/{acme_id}", KEYS["acme"])
    assert (status, answer.get("id")) == (200, acme_id)
    status, answer, _ = await get(west, f"/v1/responses/{spare_id}", KEYS["other"])
    assert (status, answer.get("id")) == (200, spare_id)
    forged = value(await scrape(west), "globalpool_response_lookups_total", outcome="forged")
    assert forged >= 5, forged


async def test_a_deeply_nested_response_record_is_a_404(
        fleet: OpsFleet, monkeypatch: pytest.MonkeyPatch) -> None:
    await responses_fleet(fleet, monkeypatch)
    east, west = fleet.urls
    other_id = await new_response(east, KEYS["other"])
    async with attacker(fleet) as redis:
        await redis.set(f"{fleet.key_prefix}:response:{other_id}", "[" * 1000 + "]" * 1000)
    async with aiohttp.ClientSession() as session, session.get(
            f"{west}/v1/responses/{other_id}",
            headers={"Authorization": f"Bearer {KEYS['other']}"}) as response:
        status, text = response.status, await response.text()
    assert status == 404 and is_unknown(json.loads(text), other_id), (status, text[:200])
    status, answer, _ = await create(west, {"model": "m", "input": "x",
                                            "previous_response_id": other_id}, KEYS["other"])
    assert status == 404, (status, answer)


# --- peer reports --------------------------------------------------------------------------

def rss_mib() -> float:
    """This process's resident set (the routers run in it)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


FAKE_ROUTERS = 150
FAKE_WORKERS_EACH = 2000


def flood_report(number: int, rng: random.Random) -> bytes:
    """An unsigned report of fake router `number`: one open request on each of
    FAKE_WORKERS_EACH fake workers, and 50 prompts it claims it sent to fake workers."""
    shared = SharedSends()
    shared.wrote = {f"ghost-{number}-{n}": 10 for n in range(100)}
    shared.served = [(f"ghost-{number}-{n}" + "x" * 200,
                      tuple(rng.randrange(1 << 32) for _ in range(32)), 1000)
                     for n in range(50)]
    return encode_report(f"fake-router-{number}",
                         {f"ghost-{number}-{n}": 1 for n in range(FAKE_WORKERS_EACH)},
                         region="us-east", affinity=shared, sent_at_s=time.time(), seq=1)


async def status_peers(url: str) -> dict[str, int]:
    status, document = await admin(url, "GET", "/admin/status")
    assert status == 200
    peers = document["router"]["peers"]
    assert isinstance(peers, dict)
    return peers


async def test_a_flood_of_unsigned_peer_reports_keeps_the_router_bounded(
        fleet: OpsFleet) -> None:
    """Unsigned mode (heartbeat.insecure, the documented opt-out). The attacker publishes,
    as fast as it can for at most 4 s, reports of 150 fake routers, each naming 2,000
    fake workers and claiming 50 prompts for fake workers. What must hold (checked before
    the one that does not): real requests are served throughout, the exchange loop
    survives and forgets the fakes once they fall silent, and the router keeps nothing of
    workers it does not know (router.registry.peers `_known_only`; before, 150 fake
    routers held 300,000 entries)."""
    await fleet.start({"a": "us-east", "c": "eu-west"})
    rng = random.Random(7)
    reports = [flood_report(n, rng) for n in range(FAKE_ROUTERS)]
    channel = f"{fleet.key_prefix}:routers:inflight"
    rss_before = rss_mib()
    most_peers, most_entries, served = 0, 0, []
    async with attacker(fleet) as redis:
        deadline = time.monotonic() + 4.0
        for round_ in range(3):
            if time.monotonic() > deadline:
                break
            for report in reports:
                await redis.publish(channel, report)
            await asyncio.sleep(0.3)  # the router reads what arrived
            served.append((await chat(fleet.url))[0])
            peers = await status_peers(fleet.url)
            most_peers = max(most_peers, len(peers))
            most_entries = max(most_entries, sum(peers.values()))
            del round_
    rss_growth = rss_mib() - rss_before
    assert served == [200] * len(served), served
    assert await crashes(fleet.url, "peer-exchange") == 0
    for _ in range(30):  # PEER_TTL_S (2 s) after the flood stops; 6 s at most
        if not await status_peers(fleet.url):
            break
        await asyncio.sleep(0.2)
    assert await status_peers(fleet.url) == {}, "the fake senders were never forgotten"
    assert [(await chat(fleet.url))[0] for _ in range(3)] == [200] * 3
    print(f"flood: at most {most_peers} peers, {most_entries} open entries, "
          f"RSS +{rss_growth:.0f} MiB")
    # A router need keep nothing of workers it does not know, nor an unbounded set of
    # senders (signed mode keeps the last `seq` of at most ~4 x 1,024 of them).
    assert most_entries == 0, (
        f"the router held {most_entries} open requests on workers that do not exist, "
        f"from {most_peers} senders (RSS +{rss_growth:.0f} MiB)")


async def test_a_signed_reports_affinity_claims_are_trusted_as_its_key_is(
        fleet: OpsFleet, monkeypatch: pytest.MonkeyPatch) -> None:
    """Signed mode. A report signed with the fleet key (a replica, or whoever holds the
    key: the agents do too, and can forge any heartbeat with it) claims it sent long
    prompts to the eu-west worker (80 ms away) and to a worker that does not exist. The
    router cannot check such a claim and believes it, as it believes that key's
    heartbeats (README, "Beyond heartbeats"): the claimed prompts may then go to the far
    worker, whose prefill they would spare. What holds: nothing goes to the ghost, every
    request is answered, the exchange does not crash."""
    await fleet.start({"a": "us-east", "c": "eu-west"}, config=signed(
        monkeypatch, fleet_config(fleet.redis_url, fleet.key_prefix)))
    key_id, secret = SIGNING_KEYS.split(":")
    prompts = [f"You are assistant {n}. " + f"Rule {n}: be brief. " * 300 for n in range(3)]
    shared = SharedSends()
    shared.served = [("c", prefix_keys_of([prompts[0]]), 1500),
                     ("ghost-worker", prefix_keys_of([prompts[1]]), 1500),
                     ("c", prefix_keys_of([prompts[2]]), 1500)]
    shared.wrote = {"ghost-worker": 10**9}
    affinity = fleet.apps[0][PROXY].policy.context.affinity
    async with attacker(fleet) as redis:
        for seq in range(1, 4):  # bounded: the exchange may be between subscriptions
            await redis.publish(f"{fleet.key_prefix}:routers:inflight", encode_report(
                "signed-liar", {}, (key_id, secret.encode()), "us-east", None, shared,
                time.time(), seq))
            await asyncio.sleep(0.3)
            if affinity.lookup(None, prefix_keys_of([prompts[0]])):
                break
    assert "c" in affinity.lookup(None, prefix_keys_of([prompts[0]])), "claim not taken"
    picks = []
    async with aiohttp.ClientSession() as session:
        for prompt in prompts * 2:
            body = {**CHAT, "messages": [{"role": "system", "content": prompt},
                                         {"role": "user", "content": "hi"}]}
            async with session.post(f"{fleet.url}/v1/chat/completions",
                                    json=body) as response:
                assert response.status == 200, await response.text()
                picks.append((response.headers[WORKER_HEADER],
                              response.headers[ROUTE_HEADER]))
    assert {worker for worker, _ in picks} <= {"a", "c"}, picks
    assert await crashes(fleet.url, "peer-exchange") == 0
