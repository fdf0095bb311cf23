"""An attacker with write access to the router's Redis, beyond heartbeats.

Heartbeats (and load records, and the Responses API's records) are signed: a forged one
is refused (tests/integration/test_secure_default.py, test_security.py, test_responses.py).
These tests write into a real Valkey with redis-py, as that attacker would, everything
else a real router reads there and trusts: drain flags, batch records and their chunk
queues, file records, and the replicas' reports of their open requests. The routers are
real router apps in front of real simulators (tests.integration.operators_fleet), nothing
of the project mocked.

What should hold for each (README, "Bad input"): a clear refusal, counted or logged,
nothing lost, nothing crashes, no other tenant's data, no internal address, no file
outside the blob directory, no traffic steered. With heartbeat keys, batch records are
signed too (router.batch.seal): their `doc` (owner, API key, input file) and every line's
result; their status and counts are not (README, "Beyond heartbeats"), so what a forged
status may do is bounded here, not prevented.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import aiohttp
import pytest
from openai import NotFoundError
from redis.asyncio import Redis

from tests.integration.operators_fleet import (
    TOKEN,
    OpsFleet,
    admin,
    chat,
    fleet_config,
    scrape,
    value,
)
from tests.integration.test_batches import (
    KEYS,
    client,
    config,
    jsonl,
    lines_of,
    submit,
    until_status,
)

pytestmark = pytest.mark.integration

SIGNING_KEYS = "attacker-test-k1:0123456789abcdef0123456789"
TWO_REGIONS = {"a": "us-east", "c": "eu-west"}
ENDED = ("completed", "failed", "expired", "cancelled")


@contextlib.asynccontextmanager
async def attacker(fleet: OpsFleet) -> AsyncIterator[Redis]:
    """A plain redis-py client of the fleet's Valkey: the attacker's."""
    redis = Redis.from_url(fleet.redis_url)
    try:
        yield redis
    finally:
        await redis.aclose()


def signed(monkeypatch: pytest.MonkeyPatch, document: dict[str, Any]) -> dict[str, Any]:
    """`document` for a fleet whose heartbeats (and so peer reports) are signed: the key in
    the environment, where both the fleet's publisher and the routers read it."""
    monkeypatch.setenv("GLOBALPOOL_HEARTBEAT_KEYS", SIGNING_KEYS)
    document.pop("heartbeat", None)
    return document


async def crashes(url: str, task: str) -> float:
    return value(await scrape(url), "globalpool_background_task_crashes_total", task=task)


async def forge_batch(redis: Redis, prefix: str, batch_id: str, fields: dict[str, Any],
                      *, owner: str = "-", todo: int = 0) -> None:
    """A batch record as BatchStore keeps it, written by the attacker, listed as active
    and in `owner`'s listing, with `todo` chunks queued."""
    key = f"{prefix}:batch:{{{batch_id}}}"
    await redis.hset(key, mapping=cast(Any, fields))
    await redis.sadd(f"{prefix}:batches:active", batch_id)
    await redis.zadd(f"{prefix}:batches:owner:{owner}", {batch_id: int(time.time())})
    if todo:
        await redis.rpush(f"{key}:todo", *range(todo))


def batch_doc(batch_id: str, input_file_id: str, **changes: Any) -> str:
    now = int(time.time())
    return json.dumps({"id": batch_id, "endpoint": "/v1/chat/completions",
                       "input_file_id": input_file_id, "completion_window": "24h",
                       "created_at": now, "expires_at": now + 86_400, "metadata": None,
                       "owner": None, "key_id": None, **changes})


# --- batch records -------------------------------------------------------------------------

POISON = {
    "doc_not_json": {"doc": "{not json", "status": "in_progress", "total": "1"},
    "doc_without_expiry": {"doc": json.dumps({"owner": None}), "status": "validating"},
    # Finalizing would walk a line at a time through 10^15 of them: the runner hangs.
    "total_absurd": {"doc": batch_doc("batch_forged_total_absurd", "file-" + "C" * 24),
                     "status": "finalizing", "total": "1" + "0" * 15},
}


@pytest.mark.parametrize("poison", sorted(POISON))
async def test_a_malformed_batch_record_does_not_stop_other_batches(
        fleet: OpsFleet, poison: str) -> None:
    await fleet.start(TWO_REGIONS, config=config(fleet))
    async with attacker(fleet) as redis:
        await forge_batch(redis, fleet.key_prefix, f"batch_forged_{poison}", POISON[poison])
    async with client(fleet.url) as openai:
        created = await submit(openai, jsonl(4))
        deadline = time.monotonic() + 10
        done = await openai.batches.retrieve(created.id)
        while done.status not in ENDED and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            done = await openai.batches.retrieve(created.id)
    runner_crashes = await crashes(fleet.url, "batch-runner")
    assert done.status == "completed", (
        f"a tenant's batch stayed {done.status!r} for 10 s; the batch runner crashed "
        f"{runner_crashes:.0f} times on the forged record")
    assert runner_crashes == 0


async def test_a_malformed_batch_record_in_a_listing_is_skipped(fleet: OpsFleet) -> None:
    await fleet.start(TWO_REGIONS, config=config(fleet))
    async with client(fleet.url) as openai:
        created = await submit(openai, jsonl(2))
        await until_status(openai, created.id, ENDED, timeout_s=15)
    async with attacker(fleet) as redis:
        # Not active (the runner is not asked to run it): only the tenant's listing names it.
        await redis.hset(f"{fleet.key_prefix}:batch:{{batch_forged_list}}",
                         mapping={"doc": "[1, 2", "status": "completed", "total": "NaN"})
        await redis.zadd(f"{fleet.key_prefix}:batches:owner:-",
                         {"batch_forged_list": int(time.time()) + 10})
    async with aiohttp.ClientSession() as session, session.get(
            f"{fleet.url}/v1/batches") as response:
        status, text = response.status, await response.text()
    assert status == 200, (status, text[:300])
    assert created.id in text and "batch_forged_list" not in text


async def test_a_forged_input_file_id_reads_no_file_outside_the_blob_directory(
        fleet: OpsFleet, tmp_path: Path) -> None:
    """A batch forged straight into `in_progress` (skipping validation, which checks the
    input file's id and owner) whose input file id is a path: the runner reads its lines
    from the blob store by that id. What holds: obstore refuses `..` and empty segments,
    so nothing outside the blob directory is read and nothing is sent. What does not: the
    ValueError it raises crashes the runner, so real batches stop."""
    await fleet.start(TWO_REGIONS, config=config(fleet))
    canary = jsonl(3)  # valid batch lines: had the runner read them, the workers would see them
    (tmp_path / "canary.jsonl").write_bytes(canary)
    forged = {
        "batch_forged_dotdot": "../canary.jsonl",
        "batch_forged_dotdot2": "files/../../canary.jsonl",
        "batch_forged_absolute": str(tmp_path / "canary.jsonl"),
    }
    assert (tmp_path / "files").is_dir()  # the blob directory (batch.storage)
    async with attacker(fleet) as redis:
        for batch_id, file_id in forged.items():
            await forge_batch(redis, fleet.key_prefix, batch_id, {
                "doc": batch_doc(batch_id, file_id), "status": "in_progress", "model": "m",
                "total": "3", "completed": "0", "failed": "0"}, todo=1)
        async with client(fleet.url) as openai:
            created = await submit(openai, jsonl(4))
            await asyncio.sleep(3.0)  # scans every ~0.5 s
            done = await openai.batches.retrieve(created.id)
        for batch_id in forged:
            results = await redis.hlen(f"{fleet.key_prefix}:batch:{{{batch_id}}}:results")
            assert results == 0, f"{batch_id}: the runner read lines from outside the store"
    samples = await scrape(fleet.url)
    lines = value(samples, "globalpool_batch_lines_total")
    assert lines <= 4, f"only the real batch's 4 lines may have run, not {lines}"
    runner_crashes = value(samples, "globalpool_background_task_crashes_total",
                           task="batch-runner")
    assert runner_crashes == 0 and done.status == "completed", (
        f"the batch runner crashed {runner_crashes:.0f} times; a real batch is "
        f"{done.status!r} after 3 s")


async def test_a_forged_input_file_id_that_names_no_blob_ends_its_batch(
        fleet: OpsFleet, tmp_path: Path) -> None:
    """An input file id that obstore takes as a name (percent signs, a missing blob) is
    not found: the forged batch ends `failed`, the runner keeps running real batches."""
    await fleet.start(TWO_REGIONS, config=config(fleet))
    (tmp_path / "canary.jsonl").write_bytes(jsonl(3))
    async with attacker(fleet) as redis:
        await forge_batch(redis, fleet.key_prefix, "batch_forged_encoded", {
            "doc": batch_doc("batch_forged_encoded", "%2e%2e/canary.jsonl"),
            "status": "in_progress", "model": "m", "total": "3", "completed": "0",
            "failed": "0"}, todo=1)
        async with client(fleet.url) as openai:
            created = await submit(openai, jsonl(4))
            done = await until_status(openai, created.id, ENDED, timeout_s=15)
            assert done.status == "completed"
            forged = await openai.batches.retrieve("batch_forged_encoded")
            assert forged.status in ("finalizing", "failed"), forged.status
        assert await redis.hlen(
            f"{fleet.key_prefix}:batch:{{batch_forged_encoded}}:results") == 0
    samples = await scrape(fleet.url)
    assert value(samples, "globalpool_batch_lines_total") == 4
    assert value(samples, "globalpool_background_task_crashes_total",
                 task="batch-runner") == 0


async def test_a_rewritten_batch_owner_or_key_is_not_found_by_anyone(
        fleet: OpsFleet, monkeypatch: pytest.MonkeyPatch) -> None:
    """With heartbeat keys, a batch's doc is signed (router.batch.seal): an attacker who
    moves acme's batch to tenant `other` (owner rewritten, filed in other's listing) or
    makes it run as `other`'s API key shows `other` nothing, and the batch is not run
    under the forged record; the doc copied onto another batch id is refused too."""
    await fleet.start(TWO_REGIONS, config=signed(monkeypatch, config(fleet, keys=True)))
    async with client(fleet.url, KEYS["acme"]) as acme:
        created = await submit(acme, jsonl(2), project="acme-secret-metadata")
        await until_status(acme, created.id, ENDED, timeout_s=20)
        kept = await submit(acme, jsonl(2))  # untouched: still acme's
    prefix = fleet.key_prefix
    async with attacker(fleet) as redis:
        key = f"{prefix}:batch:{{{created.id}}}"
        record = {str(k, "utf-8"): str(v, "utf-8")
                  for k, v in cast(dict[bytes, bytes], await redis.hgetall(key)).items()}
        assert record["doc_signature"], "the batch's doc is not signed"
        doc = json.loads(record["doc"])
        for forged_id, changes in (("owner", {"owner": "other"}),
                                   ("key", {"owner": "other", "key_id": "other-key"})):
            forged = f"batch_forged_{forged_id}"
            await forge_batch(redis, prefix, forged, {
                **record, "doc": json.dumps({**doc, "id": forged, **changes}),
                "status": "in_progress", "total": "2"}, owner="other", todo=1)
        copy = "batch_forged_copy"  # the doc and its signature as they are, another id
        await forge_batch(redis, prefix, copy, {**record, "status": "completed"},
                          owner="acme")
    async with client(fleet.url, KEYS["other"]) as other:
        listed = [batch.id async for batch in other.batches.list()]
        assert listed == [], listed
        for forged in ("batch_forged_owner", "batch_forged_key"):
            with pytest.raises(NotFoundError):
                await other.batches.retrieve(forged)
    async with client(fleet.url, KEYS["acme"]) as acme:
        with pytest.raises(NotFoundError):
            await acme.batches.retrieve(copy)
        assert (await acme.batches.retrieve(created.id)).metadata == {
            "project": "acme-secret-metadata"}
        assert (await until_status(acme, kept.id, ENDED, timeout_s=20)).status == "completed"
    samples = await scrape(fleet.url)
    assert value(samples, "globalpool_batch_lines_total") == 4, "a forged batch ran"
    assert value(samples, "globalpool_background_task_crashes_total",
                 task="batch-runner") == 0


async def test_forged_results_never_reach_the_output_file(
        fleet: OpsFleet, monkeypatch: pytest.MonkeyPatch) -> None:
    """With heartbeat keys every line's result is signed with the batch id and its index:
    answers an attacker writes into a batch's results (before its lines run, so that the
    runner's write-once keeps them, or over results already there) are replaced by
    `result_not_signed` errors when the batch is finalized; garbage indexes are ignored.
    (A signed result moved to another index or batch: tests/unit/test_batch_seal.py.)"""
    await fleet.start(TWO_REGIONS, config=signed(monkeypatch, config(fleet, keys=True)))
    async with client(fleet.url, KEYS["acme"]) as acme:
        created = await submit(acme, jsonl(6))
        results = f"{fleet.key_prefix}:batch:{{{created.id}}}:results"
        forged_line = json.dumps({"id": "x", "custom_id": "req-0", "error": None,
                                  "response": {"status_code": 200, "request_id": "x",
                                               "body": {"text": "ATTACKER"}}},
                                 separators=(",", ":"))
        async with attacker(fleet) as redis:
            await redis.hset(results, mapping={"0": forged_line, "1": forged_line,
                                               "not-a-number": forged_line,
                                               "999999999999": forged_line})
        done = await until_status(acme, created.id, ENDED, timeout_s=20)
        output = await lines_of(acme, done.output_file_id)
        errors = await lines_of(acme, done.error_file_id)
    everything = json.dumps([output, errors])
    assert "ATTACKER" not in everything
    assert sorted(line["custom_id"] for line in output + errors) == [
        f"req-{i}" for i in range(6)]
    refused = sorted(line["custom_id"] for line in errors
                     if line["error"] and line["error"]["code"] == "result_not_signed")
    assert refused == ["req-0", "req-1"], errors


# --- file records --------------------------------------------------------------------------

async def test_a_rewritten_file_owner_does_not_serve_another_tenants_file(
        fleet: OpsFleet, monkeypatch: pytest.MonkeyPatch) -> None:
    # Heartbeats signed (the default a deployment has): file records are signed too.
    await fleet.start(TWO_REGIONS, config=signed(monkeypatch, config(fleet, keys=True)))
    secret = b'{"custom_id": "acme-private", "note": "acme only"}\n'
    async with client(fleet.url, KEYS["acme"]) as acme:
        uploaded = await acme.files.create(file=("private.jsonl", io.BytesIO(secret)),
                                           purpose="user_data")
    async with attacker(fleet) as redis:
        key = f"{fleet.key_prefix}:file:{uploaded.id}"
        raw = await redis.get(key)
        assert raw is not None
        record = json.loads(raw)
        assert record["owner"] == "acme"
        record["owner"] = "other"
        await redis.set(key, json.dumps(record, separators=(",", ":")))
        await redis.zadd(f"{fleet.key_prefix}:files:other", {uploaded.id: time.time_ns()})
    async with aiohttp.ClientSession() as session, session.get(
            f"{fleet.url}/v1/files/{uploaded.id}/content",
            headers={"Authorization": f"Bearer {KEYS['other']}"}) as response:
        status, body = response.status, await response.read()
    assert secret not in body, "tenant `other` read tenant `acme`'s file"
    assert status == 404
    async with client(fleet.url, KEYS["acme"]) as acme:  # nor is it acme's any more
        assert [f.id for f in (await acme.files.list()).data] == []
        answer = await acme.files.create(file=("next.jsonl", io.BytesIO(secret)),
                                         purpose="user_data")
        assert (await acme.files.content(answer.id)).content == secret  # its own: served


async def test_forged_file_records_with_paths_or_wrong_types_are_not_found(
        fleet: OpsFleet) -> None:
    """Records under ids that are paths, and records of the wrong shape, for the caller's
    own tenant: each is a 404 (ids are checked against `file-` + 24 url-safe characters,
    records strictly typed), never a 500 or a file outside the store."""
    await fleet.start(TWO_REGIONS, config=config(fleet, keys=True))
    prefix = fleet.key_prefix
    good_id = "file-" + "A" * 24
    shapes: dict[str, Any] = {
        "file-../../../../etc/passwd": {"id": "file-../../../../etc/passwd"},
        good_id: {"id": good_id, "owner": "other", "filename": "x", "purpose": "batch",
                  "size_bytes": float("inf"), "created_at": -1, "lines": "many"},
    }
    async with attacker(fleet) as redis:
        for file_id, fields in shapes.items():
            record = {"owner": "other", "filename": "../../etc/passwd", "purpose": "batch",
                      "size_bytes": 10, "created_at": 0, **fields}
            await redis.set(f"{prefix}:file:{file_id}", json.dumps(record))
            await redis.zadd(f"{prefix}:files:other", {file_id: time.time_ns()})
        await redis.set(f"{prefix}:file:file-{'B' * 24}", b"x" * 10_000_000)  # 10 MB
        await redis.zadd(f"{prefix}:files:other", {f"file-{'B' * 24}": time.time_ns()})
    headers = {"Authorization": f"Bearer {KEYS['other']}"}
    async with aiohttp.ClientSession(headers=headers) as session:
        for file_id in [*shapes, f"file-{'B' * 24}"]:
            for path in (f"/v1/files/{file_id}", f"/v1/files/{file_id}/content"):
                async with session.get(f"{fleet.url}{path}") as response:
                    text = await response.text()
                    assert response.status == 404, (path, response.status, text[:200])
                    assert "root:" not in text
        async with session.get(f"{fleet.url}/v1/files") as response:
            # (The listing shows the record filed under a path-like id: records are not
            # checked against their key there; its content is still a 404 above.)
            assert response.status == 200 and "root:" not in await response.text()


# --- drain flags ---------------------------------------------------------------------------

async def regions_served(url: str, count: int) -> dict[str, int]:
    served: dict[str, int] = {}
    for _ in range(count):
        status, region, _ = await chat(url)
        key = region if status == 200 else f"HTTP {status}"
        served[key] = served.get(key, 0) + 1
    return served


async def test_a_forged_drain_flag_does_not_steer_traffic(
        fleet: OpsFleet, monkeypatch: pytest.MonkeyPatch) -> None:
    await fleet.start(TWO_REGIONS, config=signed(
        monkeypatch, fleet_config(fleet.redis_url, fleet.key_prefix)))
    assert await regions_served(fleet.url, 5) == {"us-east": 5}
    async with attacker(fleet) as redis:
        await redis.hset(f"{fleet.key_prefix}:drains", "region:us-east", json.dumps(
            {"kind": "region", "name": "us-east", "since_unix_s": time.time(),
             "reason": "maintenance", "by": "ops"}))
        await redis.set(f"{fleet.key_prefix}:drains:epoch", "1-forged", nx=True)
    await asyncio.sleep(1.5)  # three polls of the flags
    served = await regions_served(fleet.url, 10)
    assert served == {"us-east": 10}, f"a forged drain flag moved traffic: {served}"
    _, status = await admin(fleet.url, "GET", "/admin/status")
    assert status["security"]["drain_flags_not_signed"] == 1
    # The operator's own drain, through the admin API, is signed and takes effect.
    drained, _ = await admin(fleet.url, "POST", "/admin/drain", body={"region": "us-east"})
    assert drained == 200
    assert await regions_served(fleet.url, 5) == {"eu-west": 5}


async def status_text(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(
            f"{url}/admin/status", headers={"Authorization": f"Bearer {TOKEN}"}) as response:
        assert response.status == 200
        return await response.text()


def strict_json(text: str) -> Any:
    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: it holds {constant}")

    return json.loads(text, parse_constant=refuse)


async def test_garbage_drain_records_are_survived(fleet: OpsFleet) -> None:
    """Drain fields and values of wrong shapes (unknown kinds, empty names, non-JSON, wrong
    types, 1 MB reasons), naming no real target: the router keeps serving, its flags keep
    being read (a real drain written after them takes effect), /admin/status answers."""
    await fleet.start(TWO_REGIONS, config=fleet_config(fleet.redis_url, fleet.key_prefix))
    garbage = {
        "bogus:x": "{}", "region:": "{}", ":": "", "worker": "x",
        "region:nowhere": "not json",
        "worker:ghost-2": json.dumps({"since_unix_s": "yesterday", "reason": ["a"], "by": 7}),
        "worker:ghost-4": '{"since_unix_s": 12, "reason": "' + "r" * 1_000_000 + '"}',
        "worker:ghost-6": "[]",
    }
    async with attacker(fleet) as redis:
        await redis.hset(f"{fleet.key_prefix}:drains", mapping=cast(Any, garbage))
    await asyncio.sleep(1.2)
    assert await regions_served(fleet.url, 4) == {"us-east": 4}
    status, document = await admin(fleet.url, "POST", "/admin/drain",
                                   body={"region": "us-east", "reason": "real"})
    assert status == 200, document
    assert await regions_served(fleet.url, 4) == {"eu-west": 4}
    strict_json(await status_text(fleet.url))
    assert await crashes(fleet.url, "drain-flags") == 0


async def test_a_deeply_nested_drain_record_does_not_stop_drains(fleet: OpsFleet) -> None:
    await fleet.start(TWO_REGIONS, config=fleet_config(fleet.redis_url, fleet.key_prefix))
    async with attacker(fleet) as redis:
        await redis.hset(f"{fleet.key_prefix}:drains", "worker:ghost",
                         "[" * 100_000 + "]" * 100_000)
    await asyncio.sleep(1.2)
    assert await regions_served(fleet.url, 2) == {"us-east": 2}  # serving goes on
    status, _ = await admin_raw(fleet.url, "/admin/drain", {"region": "us-east"})
    drain_crashes = await crashes(fleet.url, "drain-flags")
    assert status == 200 and drain_crashes == 0, (
        f"POST /admin/drain answered {status}; the drain-flags task crashed "
        f"{drain_crashes:.0f} times")


async def test_infinite_drain_times_keep_admin_status_json(fleet: OpsFleet) -> None:
    await fleet.start(TWO_REGIONS, config=fleet_config(fleet.redis_url, fleet.key_prefix))
    async with attacker(fleet) as redis:
        await redis.hset(f"{fleet.key_prefix}:drains", mapping=cast(Any, {
            "worker:ghost-3": '{"since_unix_s": NaN}',
            "worker:ghost-4": '{"since_unix_s": 1e999}'}))
    await asyncio.sleep(1.2)
    strict_json(await status_text(fleet.url))


async def admin_raw(url: str, path: str, body: dict[str, Any]) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.post(
            f"{url}{path}", json=body,
            headers={"Authorization": f"Bearer {TOKEN}"}) as response:
        return response.status, await response.text()


# --- peer reports --------------------------------------------------------------------------

async def test_a_replayed_peer_report_does_not_revive_a_stopped_replica(
        fleet: OpsFleet, monkeypatch: pytest.MonkeyPatch) -> None:
    await fleet.start({"a": "us-east"}, replicas=2, decode_step_ms=100.0, config=signed(
        monkeypatch, fleet_config(fleet.redis_url, fleet.key_prefix)))
    watcher, second = fleet.urls
    captured: list[tuple[int, bytes]] = []
    async with attacker(fleet) as redis:
        pubsub = redis.pubsub()
        await pubsub.subscribe(f"{fleet.key_prefix}:routers:inflight")

        async def capture(seconds: float) -> None:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                message = await pubsub.get_message(ignore_subscribe_messages=True,
                                                   timeout=0.1)
                if message is not None:
                    body = json.loads(bytes(message["data"]).split(b" ", 3)[3])
                    captured.append((sum(body["open"].values()), bytes(message["data"])))

        # A client holds four slow streams open on the second replica; the attacker listens.
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 40, "stream": True}
        async with aiohttp.ClientSession() as session:
            streams = [await session.post(f"{second}/v1/chat/completions", json=body)
                       for _ in range(4)]
            await capture(1.0)
            for stream in streams:
                stream.close()
        open_, report = max(captured)
        assert open_ == 4, captured[-3:]
        peer = json.loads(report.split(b" ", 3)[3])["router"]
        assert report.split(b" ", 3)[1] == b"attacker-test-k1"  # signed: no forgery needed

        # The second replica stops (its last report says it has nothing open).
        runner = fleet.runners.pop()
        await runner.cleanup()
        await asyncio.sleep(2.5)  # PEER_TTL_S: the watcher forgets it in any case
        _, status = await admin(watcher, "GET", "/admin/status")
        assert peer not in status["router"]["peers"]

        # The attacker replays what it captured.
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            await redis.publish(f"{fleet.key_prefix}:routers:inflight", report)
            await asyncio.sleep(0.2)
        _, status = await admin(watcher, "GET", "/admin/status")
        await pubsub.aclose()  # type: ignore[no-untyped-call]  # untyped in redis-py
    assert peer not in status["router"]["peers"], (
        f"the stopped replica counts again, {status['router']['peers'][peer]} open requests,"
        " from a replayed report")
