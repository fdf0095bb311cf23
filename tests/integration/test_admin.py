"""Admin API: the token, /admin/status, drains obeyed by every replica, hot reload, audit."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from pathlib import Path

import aiohttp
import pytest

from lab.devstack.valkey import EmbeddedValkey
from router.registry.drains import DrainKeys
from tests.integration.conftest import StartSim
from tests.integration.operators_fleet import (
    CHAT,
    TOKEN,
    OpsFleet,
    admin,
    chat,
    fleet_config,
    scrape,
    value,
    wait_for,
)
from worker.redis_client import connect

pytestmark = pytest.mark.integration



async def test_admin_api_needs_the_token(fleet: OpsFleet,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    await fleet.start({"a": "us-east"})
    status, body = await admin(fleet.url, "GET", "/admin/status", token=None)
    assert status == 401 and body["error"]["code"] == "invalid_admin_token"
    status, _ = await admin(fleet.url, "GET", "/admin/status", token=TOKEN + "x")
    assert status == 401
    status, _ = await admin(fleet.url, "POST", "/admin/drain", token="",
                            body={"region": "us-east"})
    assert status == 401
    status, body = await admin(fleet.url, "GET", "/admin/status")
    assert status == 200 and body["router"]["region"] == "us-east"
    monkeypatch.delenv("GLOBALPOOL_ADMIN_TOKEN")
    status, body = await admin(fleet.url, "GET", "/admin/status")
    assert status == 403 and "GLOBALPOOL_ADMIN_TOKEN" in body["error"]["message"]


async def test_status_shows_regions_workers_redis_and_config(fleet: OpsFleet) -> None:
    await fleet.start({"a": "us-east", "b": "us-east", "c": "eu-west"})
    for _ in range(4):
        assert (await chat(fleet.url, {**CHAT, "stream": True}))[0] == 200
    status, body = await admin(fleet.url, "GET", "/admin/status")
    assert status == 200
    assert body["redis"]["connected"] is True and body["redis"]["snapshot_age_s"] < 5
    assert body["config"]["version"] and body["config"]["last_error"] is None
    assert body["config"]["path"] == str(fleet.config_path)
    regions = {region["name"]: region for region in body["regions"]}
    assert set(regions) == {"us-east", "eu-west"}
    east = regions["us-east"]
    assert east["health"] == "ok" and east["workers"] == {"ready": 2}
    assert east["capacity_seqs"] == 16 and east["rtt_ms"] == 0.0
    assert regions["eu-west"]["rtt_ms"] == 80.0
    assert east["traffic"]["requests"] == 4 and east["traffic"]["share"] == 1.0
    assert east["traffic"]["ttft_p50_ms"] is not None
    workers = {worker["id"]: worker for worker in body["workers"]}
    assert workers["c"]["region"] == "eu-west" and workers["c"]["status"] == "ready"
    assert workers["a"]["capacity"]["max_num_seqs"] == 8
    assert workers["a"]["breaker"] == "closed"


async def test_drained_region_gets_no_new_requests_on_any_replica(
        fleet: OpsFleet, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    await fleet.start({"a": "us-east", "b": "eu-west"}, replicas=2)
    first, second = fleet.urls
    assert {(await chat(second))[1] for _ in range(3)} == {"us-east"}
    status, body = await admin(first, "POST", "/admin/drain",
                               body={"region": "us-east", "reason": "maintenance"})
    assert status == 200 and body["drained"]["name"] == "us-east"
    # The replica that took the command obeys at once ...
    assert {(await chat(first))[1] for _ in range(5)} == {"eu-west"}

    # ... and the other within a second (it re-reads the flags every 0.5 s).
    async def second_obeys() -> bool:
        return (await chat(second))[1] == "eu-west"

    assert await wait_for(second_obeys, timeout_s=5.0) < 1.5
    assert {(await chat(second))[1] for _ in range(5)} == {"eu-west"}
    _, body = await admin(second, "GET", "/admin/status")
    regions = {region["name"]: region for region in body["regions"]}
    assert regions["us-east"]["health"] == "drained" and regions["us-east"]["drained"]
    assert [(d["kind"], d["name"], d["reason"]) for d in body["drains"]] == [
        ("region", "us-east", "maintenance")]

    status, body = await admin(first, "POST", "/admin/undrain", body={"region": "us-east"})
    assert status == 200 and body["was_drained"] is True

    async def back() -> bool:
        return (await chat(second))[1] == "us-east"

    await wait_for(back, timeout_s=5.0)
    audit = [r.getMessage() for r in caplog.records if r.name == "globalpool.audit"]
    assert any("action=drain target=region:us-east" in line and "result=ok" in line
               for line in audit)
    assert any("action=undrain target=region:us-east" in line for line in audit)
    assert TOKEN not in caplog.text


async def test_drained_worker_and_everything_drained(fleet: OpsFleet) -> None:
    await fleet.start({"a": "us-east", "b": "us-east"})
    status, _ = await admin(fleet.url, "POST", "/admin/drain", body={"worker": "a"})
    assert status == 200
    workers: Counter[str] = Counter()
    for _ in range(6):
        async with aiohttp.ClientSession() as session, session.post(
                f"{fleet.url}/v1/chat/completions", json=CHAT) as response:
            assert response.status == 200
            workers[response.headers["x-globalpool-worker"]] += 1
    assert set(workers) == {"b"}
    await admin(fleet.url, "POST", "/admin/drain", body={"worker": "b"})
    status, _, answer = await chat(fleet.url)
    assert status == 503 and b"drained" in answer
    _, body = await admin(fleet.url, "GET", "/admin/status")
    assert {w["id"]: w["status"] for w in body["workers"]} == {"a": "drained", "b": "drained"}


async def test_drain_refuses_unknown_targets_and_bad_bodies(fleet: OpsFleet) -> None:
    await fleet.start({"a": "us-east"})
    status, body = await admin(fleet.url, "POST", "/admin/drain", body={"region": "mars"})
    assert status == 404 and "no region named 'mars'" in body["error"]["message"]
    status, _ = await admin(fleet.url, "POST", "/admin/drain",
                            body={"region": "us-east", "worker": "a"})
    assert status == 400
    status, _ = await admin(fleet.url, "POST", "/admin/drain", body={"worker": "zz"})
    assert status == 404


async def test_hot_reload_takes_a_good_file_and_refuses_a_bad_one(
        fleet: OpsFleet, redis_url: str, key_prefix: str,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    await fleet.start({"a": "us-east", "b": "eu-west"}, decode_step_ms=20.0)
    _, before = await admin(fleet.url, "GET", "/admin/status")
    assert {(await chat(fleet.url))[1] for _ in range(3)} == {"us-east"}

    # A stream in flight while the file changes twice: it finishes normally.
    async def long_stream() -> tuple[int, str, bytes]:
        return await chat(fleet.url, {**CHAT, "stream": True, "max_tokens": 40})

    in_flight = asyncio.create_task(long_stream())
    await asyncio.sleep(0.1)

    # A good file: us-east is now far from its own router (rtt) -> traffic spills over.
    good = fleet_config(redis_url, key_prefix)
    good["regions"]["us-east"]["rtt_ms"] = {"us-east": 500, "eu-west": 80}
    fleet.write_config(good)

    async def version_changed() -> bool:
        _, body = await admin(fleet.url, "GET", "/admin/status")
        return bool(body["config"]["version"] != before["config"]["version"])

    await wait_for(version_changed)
    assert {(await chat(fleet.url))[1] for _ in range(3)} == {"eu-west"}

    # A bad file: refused, named by path; the good config stays in force.
    bad = fleet_config(redis_url, key_prefix)
    bad["regions"]["eu-west"]["rtt_ms"] = {"us-east": -5}
    fleet.write_config(bad)

    async def refused() -> bool:
        _, body = await admin(fleet.url, "GET", "/admin/status")
        return body["config"]["last_error"] is not None

    await wait_for(refused)
    _, body = await admin(fleet.url, "GET", "/admin/status")
    assert body["config"]["last_error"]["problems"] == [
        f"{fleet.config_path}: regions.eu-west.rtt_ms.us-east: must be >= 0"]
    assert body["config"]["reload_errors"] == 1
    assert {(await chat(fleet.url))[1] for _ in range(3)} == {"eu-west"}  # still the good one
    assert f"{fleet.config_path}: regions.eu-west.rtt_ms.us-east: must be >= 0" in caplog.text
    kinds = [event["kind"] for event in body["events"]]
    assert "config_refused" in kinds and "config_reloaded" in kinds

    status, _, answer = await in_flight
    assert status == 200 and answer.rstrip().endswith(b"data: [DONE]")

    # Fixing the file clears the error.
    fleet.write_config(good)

    async def cleared() -> bool:
        _, body = await admin(fleet.url, "GET", "/admin/status")
        return body["config"]["last_error"] is None

    await wait_for(cleared)


async def test_reload_endpoint_and_restart_only_settings(fleet: OpsFleet, redis_url: str,
                                                         key_prefix: str) -> None:
    config = fleet_config(redis_url, key_prefix)
    config["admin"] = {"config_check_s": 0}  # only on demand
    await fleet.start({"a": "us-east"}, config=config)
    status, body = await admin(fleet.url, "POST", "/admin/reload")
    assert status == 200 and body["result"] == "unchanged"
    changed = fleet_config(redis_url, key_prefix, port=1234)
    changed["admin"] = {"config_check_s": 0}
    fleet.write_config(changed)
    status, body = await admin(fleet.url, "POST", "/admin/reload")
    assert status == 200 and body["result"] == "reloaded"
    _, body = await admin(fleet.url, "GET", "/admin/status")
    assert body["config"]["restart_required"] == ["router.port"]
    fleet.config_path.write_text("apiVersion: globalpool/v1\nregions: [\n")
    status, body = await admin(fleet.url, "POST", "/admin/reload")
    assert status == 422 and body["result"] == "refused"
    assert body["problems"][0].startswith(f"{fleet.config_path}: line ")


async def test_reload_refuses_an_unknown_policy_and_takes_a_known_one(
        fleet: OpsFleet, redis_url: str, key_prefix: str) -> None:
    await fleet.start({"a": "us-east", "b": "us-east"})
    fleet.write_config(fleet_config(redis_url, key_prefix, policy="fastest-please"))
    status, body = await admin(fleet.url, "POST", "/admin/reload")
    assert status == 422
    [problem] = body["problems"]
    assert problem.startswith(f"{fleet.config_path}: router.policy: unknown policy "
                              "'fastest-please' (known: ")
    assert "round_robin" in problem
    fleet.write_config(fleet_config(redis_url, key_prefix, policy="round_robin"))
    status, body = await admin(fleet.url, "POST", "/admin/reload")
    assert status == 200 and body["result"] == "reloaded"
    workers = []
    for _ in range(4):
        async with aiohttp.ClientSession() as session, session.post(
                f"{fleet.url}/v1/chat/completions", json=CHAT) as response:
            workers.append(response.headers["x-globalpool-worker"])
    assert workers in (["a", "b", "a", "b"], ["b", "a", "b", "a"])


async def test_replicas_show_each_others_open_requests(fleet: OpsFleet) -> None:
    await fleet.start({"a": "us-east"}, replicas=2, decode_step_ms=50.0)
    first, second = fleet.urls
    streams = [asyncio.create_task(chat(first, {**CHAT, "stream": True, "max_tokens": 40}))
               for _ in range(3)]

    async def second_counts_them() -> bool:
        _, body = await admin(second, "GET", "/admin/status")
        return bool(list(body["router"]["peers"].values()) == [3])

    # Reported every 50 ms: seen well before the 2 s streams end.
    assert await wait_for(second_counts_them, timeout_s=1.5) < 1.5
    async with aiohttp.ClientSession() as session, session.get(f"{second}/metrics") as response:
        metrics = await response.text()
    assert "globalpool_peer_routers 1.0" in metrics
    assert "globalpool_peer_inflight_requests 3.0" in metrics
    assert all(status == 200 for status, _, _ in await asyncio.gather(*streams))

    async def second_sees_none_open() -> bool:
        _, body = await admin(second, "GET", "/admin/status")
        return bool(sum(body["router"]["peers"].values()) == 0)

    await wait_for(second_sees_none_open, timeout_s=2.0)


async def test_status_and_metrics_show_a_regions_latency_penalty(fleet: OpsFleet) -> None:
    """The engine prefills far slower than its heartbeats let the router predict (they
    report no performance figures, so the router assumes 4,000 tokens/s): streamed first
    bytes come late, and the router shows what it now adds to us-east's predictions."""
    await fleet.start({"a": "us-east"}, prefill_tokens_per_s=10.0)
    status, body = await admin(fleet.url, "GET", "/admin/status")
    assert status == 200
    assert [r["latency_penalty_ms"] for r in body["regions"]] == [0.0, 0.0]  # nothing yet
    for _ in range(5):
        assert (await chat(fleet.url, {**CHAT, "stream": True}))[0] == 200
    status, body = await admin(fleet.url, "GET", "/admin/status")
    assert status == 200
    regions = {region["name"]: region for region in body["regions"]}
    assert regions["us-east"]["latency_penalty_ms"] > 50.0, regions["us-east"]
    assert regions["eu-west"]["latency_penalty_ms"] == 0.0  # no samples: as predicted
    penalty = value(await scrape(fleet.url), "globalpool_region_latency_penalty_ms",
                    region="us-east")
    assert penalty == pytest.approx(regions["us-east"]["latency_penalty_ms"], rel=0.2)


async def test_a_reload_turns_the_per_worker_gauges_off(fleet: OpsFleet, redis_url: str,
                                                        key_prefix: str) -> None:
    config = fleet_config(redis_url, key_prefix)
    config["admin"] = {"config_check_s": 0}  # only on demand
    await fleet.start({"a": "us-east", "c": "eu-west"}, config=config)

    async def worker_families() -> set[str]:
        return {name for name, _ in await scrape(fleet.url)
                if name.startswith("globalpool_worker")}

    assert {"globalpool_workers", "globalpool_worker_capacity_seqs",
            "globalpool_worker_load_seqs"} <= await worker_families()
    config["router"]["worker_metrics"] = False
    fleet.write_config(config)
    status, body = await admin(fleet.url, "POST", "/admin/reload")
    assert status == 200 and body["result"] == "reloaded"
    _, body = await admin(fleet.url, "GET", "/admin/status")
    assert body["config"]["restart_required"] == []
    # (the counts by region and state, and of stuck engines by region, stay)
    assert await worker_families() == {"globalpool_workers", "globalpool_workers_engine_stuck"}


async def test_status_lists_some_workers_problems_first_and_summarises_all(
        fleet: OpsFleet) -> None:
    await fleet.start({"a": "us-east", "b": "us-east", "c": "eu-west", "d": "eu-west"})
    status, _ = await admin(fleet.url, "POST", "/admin/drain", body={"worker": "d"})
    assert status == 200
    status, body = await admin(fleet.url, "GET", "/admin/status?workers=2")
    assert status == 200 and body["workers_total"] == 4
    assert [(w["id"], w["status"]) for w in body["workers"]] == [
        ("d", "drained"), ("c", "ready")]  # the problem, then by region and id
    regions = {region["name"]: region for region in body["regions"]}
    assert regions["eu-west"]["workers"] == {"ready": 1, "drained": 1}
    assert regions["us-east"]["workers"] == {"ready": 2}  # none listed, all summarised
    assert regions["us-east"]["capacity_seqs"] == 16 and regions["us-east"]["health"] == "ok"
    _, everything = await admin(fleet.url, "GET", "/admin/status")
    assert [w["id"] for w in everything["workers"]] == ["c", "d", "a", "b"]  # by region
    assert everything["regions"] == body["regions"]
    _, none = await admin(fleet.url, "GET", "/admin/status?workers=0")
    assert none["workers"] == [] and none["workers_total"] == 4
    for bad in ("-1", "two", "1e3", ""):
        status, error = await admin(fleet.url, "GET", f"/admin/status?workers={bad}")
        assert status == 400 and error["error"]["param"] == "workers", (bad, error)


async def test_drains_come_back_when_redis_returns_empty(
        tmp_path: Path, start_sim: StartSim, key_prefix: str,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("GLOBALPOOL_ADMIN_TOKEN", TOKEN)
    server = EmbeddedValkey.start()
    fleet = OpsFleet(server.url, key_prefix, tmp_path, start_sim)
    try:
        await fleet.start({"a": "us-east", "b": "eu-west"}, replicas=2)
        first, second = fleet.urls
        status, _ = await admin(first, "POST", "/admin/drain",
                                body={"region": "us-east", "reason": "maintenance"})
        assert status == 200

        async def served_in(region: str) -> bool:
            return [(await chat(url))[1] for url in fleet.urls] == [region] * len(fleet.urls)

        async def obeyed() -> bool:
            return await served_in("eu-west")

        await wait_for(obeyed, timeout_s=5.0)
        server.stop()
        server = EmbeddedValkey.start(port=server.port)  # no persistence: it comes back empty
        returned_at = time.monotonic()
        for worker_id in ("a", "b"):  # as their agents would, at their next heartbeat
            await fleet.publish(worker_id)
        flags = connect(server.url)
        try:
            async def restored() -> bool:
                return bool(await flags.hgetall(DrainKeys(key_prefix).hash))

            await wait_for(restored, timeout_s=10.0, interval_s=0.02)
            restored_after_s = time.monotonic() - returned_at
        finally:
            await flags.aclose()
        print(f"drain flags back in Redis {restored_after_s:.3f} s after it returned empty")
        assert restored_after_s < 1.0, restored_after_s
        assert {(await chat(url))[1] for url in fleet.urls for _ in range(3)} == {"eu-west"}
        _, body = await admin(second, "GET", "/admin/status")
        assert [(d["kind"], d["name"], d["reason"]) for d in body["drains"]] == [
            ("region", "us-east", "maintenance")]
        events = [e for url in fleet.urls for e in (await admin(url, "GET", "/admin/status"))[1]
                  ["events"]]  # on the replica(s) that wrote the flag back
        assert any(e["kind"] == "drain_restored" for e in events), events
        assert "drain flags restored" in caplog.text
        # An undrain is not taken for a loss: the flag stays gone on every replica.
        status, _ = await admin(first, "POST", "/admin/undrain", body={"region": "us-east"})
        assert status == 200

        async def back() -> bool:
            return await served_in("us-east")

        await wait_for(back, timeout_s=5.0)
        await asyncio.sleep(1.2)  # two polls more: nobody writes it back
        assert await back()
    finally:
        await fleet.close()
        server.stop()
