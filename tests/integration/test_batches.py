"""OpenAI's Batch API through real router apps sharing a real Valkey and a files directory,
in front of real simulators, driven by the unchanged `openai` client.

Every input line ends up exactly once in the output or the error file; lines start only
into the batch slots that interactive traffic leaves free; a tenant sees only its own
batches."""

from __future__ import annotations

import asyncio
import io
import json
import math
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI, NotFoundError

from router.app import BATCHES, HOLDER, PROXY
from router.auth.keys import hash_key
from router.batch.lines import check_input
from router.batch.state import BatchStore
from tests.conftest import CPU_HOG, ROOT
from tests.integration.operators_fleet import (
    OpsFleet,
    admin,
    fleet_config,
    scrape,
    value,
    wait_for,
)
from worker.engine_metrics import parse_metrics
from worker.redis_client import connect

pytestmark = pytest.mark.integration

WORKERS = {"a": "us-east", "b": "us-east", "c": "eu-west"}
KEYS = {"acme": "gp-test-acme-key-1", "other": "gp-test-other-key-2"}


def config(fleet: OpsFleet, *, keys: bool = False) -> dict[str, Any]:
    document = fleet_config(fleet.redis_url, fleet.key_prefix)
    document["batch"] = {"storage": f"file://{fleet.tmp_path}/files", "lease_s": 2}
    if keys:
        document["auth"] = {
            "tenants": {tenant: {} for tenant in KEYS},
            "keys": [{"id": f"{tenant}-key", "tenant": tenant, "sha256": hash_key(key)}
                     for tenant, key in KEYS.items()]}
    return document


def client(url: str, key: str = "unused") -> AsyncOpenAI:
    return AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def jsonl(count: int, *, max_tokens: int = 4, extra: list[bytes] | None = None) -> bytes:
    rows = [json.dumps({"custom_id": f"req-{i}", "method": "POST",
                        "url": "/v1/chat/completions",
                        "body": {"model": "m", "max_tokens": max_tokens,
                                 "messages": [{"role": "user", "content": f"line {i}"}]}}
                       ).encode() for i in range(count)]
    return b"\n".join(rows + (extra or [])) + b"\n"


async def until_status(openai: AsyncOpenAI, batch_id: str, statuses: tuple[str, ...],
                       timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        batch = await openai.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        assert time.monotonic() < deadline, (batch.status, batch.request_counts)
        await asyncio.sleep(0.1)


async def beat_as_agents(fleet: OpsFleet, http: aiohttp.ClientSession,
                         interactive: Mapping[str, int], *, every_s: float,
                         seen: Callable[[str, int], None], max_num_seqs: int = 8) -> None:
    """Each worker's heartbeat as an agent would send it, every `every_s` until cancelled:
    its `interactive` requests (read at each beat) plus the lines its simulator holds,
    which `seen(worker, lines)` is told: the simulators, not the router, count what
    reaches them."""
    while True:
        for worker, sim in fleet.sims.items():
            async with http.get(f"{sim.url}/metrics") as response:
                lines = parse_metrics(await response.text()).in_flight
            await fleet.publish(worker, running=interactive[worker] + lines,
                                max_num_seqs=max_num_seqs)
            seen(worker, lines)
        await asyncio.sleep(every_s)


async def lines_of(openai: AsyncOpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    content = await openai.files.content(file_id)
    return [json.loads(line) for line in content.text.splitlines() if line]


async def submit(openai: AsyncOpenAI, data: bytes, **metadata: str) -> Any:
    uploaded = await openai.files.create(file=("input.jsonl", io.BytesIO(data)),
                                         purpose="batch")
    return await openai.batches.create(input_file_id=uploaded.id,
                                       endpoint="/v1/chat/completions",
                                       completion_window="24h", metadata=metadata or None)


async def test_a_batch_runs_and_every_line_is_answered_once(fleet: OpsFleet) -> None:
    await fleet.start(WORKERS, replicas=2, config=config(fleet))
    east, west = fleet.urls
    async with client(east) as openai, client(west) as elsewhere:
        created = await submit(openai, jsonl(60, extra=[b"{broken", b'{"custom_id": 5}']),
                               purpose="nightly")
        assert created.status == "validating" and created.metadata == {"purpose": "nightly"}
        await until_status(openai, created.id, ("in_progress", "completed"))
        status, document = await admin(east, "GET", "/admin/status")
        assert status == 200 and "batches" in document
        done = await until_status(elsewhere, created.id, ("completed", "failed"))
        assert done.status == "completed", done.errors
        assert done.request_counts.total == 62
        assert (done.request_counts.completed, done.request_counts.failed) == (60, 2)
        assert done.in_progress_at and done.finalizing_at and done.completed_at
        output = await lines_of(openai, done.output_file_id)
        errors = await lines_of(openai, done.error_file_id)
    assert sorted(line["custom_id"] for line in output) == sorted(f"req-{i}" for i in range(60))
    assert all(line["response"]["status_code"] == 200
               and line["response"]["body"]["object"] == "chat.completion" for line in output)
    assert [(line["custom_id"], line["error"]["code"]) for line in errors] == [
        (None, "invalid_json_line"), (None, "missing_required_parameter")]
    assert len({line["id"] for line in output + errors}) == 62
    # Both replicas ran lines; /metrics counts each line once, where it was served.
    counted = [await scrape(url) for url in fleet.urls]
    assert sum(value(samples, "globalpool_batch_lines_total", outcome="ok")
               for samples in counted) == 60
    assert sum(value(samples, "globalpool_batch_lines_total", outcome="rerun")
               for samples in counted) == 0
    assert sum(value(samples, "globalpool_batch_cost_estimate_dollars_total")
               for samples in counted) > 0


async def test_a_file_that_cannot_run_fails_validation_with_the_reasons(
        fleet: OpsFleet) -> None:
    await fleet.start(WORKERS, config=config(fleet))
    twice = jsonl(3) + jsonl(1)  # req-0 twice
    async with client(fleet.url) as openai:
        created = await submit(openai, twice)
        failed = await until_status(openai, created.id, ("failed", "completed"))
    assert failed.status == "failed" and failed.failed_at
    assert failed.errors is not None
    assert [(e.code, e.line) for e in failed.errors.data] == [("duplicate_custom_id", 4)]
    assert failed.output_file_id is None and failed.request_counts.completed == 0


@pytest.mark.slow(why="interactive streams held ~10 s beside a batch")
async def test_lines_wait_while_interactive_traffic_holds_the_slots(fleet: OpsFleet) -> None:
    await fleet.start(WORKERS, config=config(fleet))
    for worker in WORKERS:  # 6 of 8 slots busy: the interactive quarter is all that is left
        await fleet.publish(worker, running=6)
    async with client(fleet.url) as openai:
        created = await submit(openai, jsonl(20))
        await until_status(openai, created.id, ("in_progress",))
        await asyncio.sleep(2.0)
        waiting = await openai.batches.retrieve(created.id)
        assert waiting.status == "in_progress"
        assert waiting.request_counts is not None
        assert waiting.request_counts.completed == 0, "a line took an interactive slot"
        for worker in WORKERS:
            await fleet.publish(worker, running=0)
        done = await until_status(openai, created.id, ("completed",))
    assert done.request_counts.completed == 20


@pytest.mark.parametrize("reserve", ["adaptive", 0.25])
async def test_lines_leave_free_the_interactive_load_a_worker_carried_lately(
        fleet: OpsFleet, reserve: str | float) -> None:
    # Each worker's heartbeat says what an agent would: 4 interactive requests, plus the
    # lines its simulator holds. The batch starts; then the interactive requests end. The
    # old rule (a quarter free, 0.25) fills every worker to 6 of 8 and more at once; the
    # adaptive rule keeps free the 4 that interactive traffic needed a moment ago (+2), so
    # at most 2 lines per worker, for the 5 s watched (the peak it keeps falls back by 0.1
    # slot a second). The simulators, not the router, count what reaches them.
    document = config(fleet)
    document["batch"]["interactive_reserve"] = reserve
    await fleet.start(WORKERS, config=document, decode_step_ms=10.0)
    interactive = dict.fromkeys(WORKERS, 4)
    ended = {"at": math.inf}
    most = dict.fromkeys(WORKERS, 0)  # lines at once on each, in the 5 s after that end

    def seen(worker: str, lines: int) -> None:
        if 0 <= time.monotonic() - ended["at"] <= 5.0:
            most[worker] = max(most[worker], lines)

    async with client(fleet.url) as openai, aiohttp.ClientSession() as http:
        publishing = asyncio.create_task(
            beat_as_agents(fleet, http, interactive, every_s=0.02, seen=seen))
        try:
            created = await submit(openai, jsonl(90, max_tokens=20))
            await until_status(openai, created.id, ("in_progress",))
            await asyncio.sleep(1.0)
            interactive.update(dict.fromkeys(WORKERS, 0))
            ended["at"] = time.monotonic()
            done = await until_status(openai, created.id, ("completed", "failed"))
        finally:
            publishing.cancel()
    status, document = await admin(fleet.url, "GET", "/admin/status")
    assert status == 200 and document["batches"]["here"]["interactive_reserve"] == reserve
    assert done.status == "completed" and done.request_counts is not None
    assert done.request_counts.completed == 90
    if reserve == "adaptive":
        assert sum(most.values()) > 0 and all(lines <= 2 for lines in most.values()), most
    else:
        assert max(most.values()) >= 5, most


async def test_a_runner_holds_lines_ready_for_the_slots_that_free_before_its_next_scan(
        fleet: OpsFleet) -> None:
    # 3 workers of 16 slots, no interactive load, the fixed rule: 12 lines may run on
    # each. A runner that held only as many lines as there were spare slots at its scan
    # (none, once they were full) ran out between scans: the slots of lines that ended
    # stood idle until the next scan (bench-batch: 0.75 of the spare capacity).
    document = config(fleet)
    document["batch"]["interactive_reserve"] = 0.25
    await fleet.start(WORKERS, config=document, decode_step_ms=50.0)  # lines of ~1 s
    for worker in WORKERS:
        await fleet.publish(worker, max_num_seqs=16)
    runner = fleet.apps[0][BATCHES].runner
    async with client(fleet.url) as openai:
        created = await submit(openai, jsonl(400, max_tokens=20))
        await until_status(openai, created.id, ("in_progress",))
        deadline = time.monotonic() + 20
        while runner.lines_running < 30:  # (36 may run)
            assert time.monotonic() < deadline, runner.lines_running
            await asyncio.sleep(0.05)
        await runner.scan()
        running = runner.lines_running
        ready = sum(len(held.pending) for held in runner._held)
        await openai.batches.cancel(created.id)
        await until_status(openai, created.id, ("cancelled",))
    # Every running line's slot has a line waiting for it (chunks of 16 lines).
    assert ready >= running, (ready, running)


async def two_replicas_run_a_batch(fleet: OpsFleet, *, decode_step_ms: float,
                                   hog: bool) -> dict[str, float]:
    """Two replicas run one 200-line batch on 3 workers of 16 slots, each carrying 4
    interactive requests (its heartbeats: those plus the lines its simulator holds, every
    0.1 s), with a CPU hog taking one of the machine's cores or not. The most lines a
    worker held, and the highest interactive peak either replica kept."""
    await fleet.start(WORKERS, replicas=2, config=config(fleet), decode_step_ms=decode_step_ms)
    rooms = [app[PROXY].policy.context.batch_room for app in fleet.apps]
    most = {"lines": 0.0, "peak": 0.0}

    def seen(worker: str, lines: int) -> None:
        most["lines"] = max(most["lines"], lines)
        for room in rooms:
            most["peak"] = max(most["peak"], room.peak_of(worker) or 0.0)

    hogging = (await asyncio.create_subprocess_exec(sys.executable, "-c", CPU_HOG.format(s=40.0))
               if hog else None)
    try:
        async with client(fleet.url) as openai, aiohttp.ClientSession() as http:
            publishing = asyncio.create_task(beat_as_agents(
                fleet, http, dict.fromkeys(WORKERS, 4), every_s=0.1, seen=seen, max_num_seqs=16))
            try:
                created = await submit(openai, jsonl(200, max_tokens=20))
                done = await until_status(openai, created.id, ("completed", "failed"))
            finally:
                publishing.cancel()
    finally:
        if hogging is not None:
            hogging.kill()
            await hogging.wait()
    assert done.status == "completed" and done.request_counts is not None
    assert done.request_counts.completed == 200
    ran = [value(await scrape(url), "globalpool_batch_lines_total", outcome="ok")
           for url in fleet.urls]
    print(f"lines run by each replica {ran}; the most seen {most}")
    assert min(ran) > 0, ran  # both replicas ran lines
    return most


async def test_replicas_sharing_a_batch_do_not_take_each_others_lines_for_interactive_load(
        fleet: OpsFleet) -> None:
    # Each replica keeps free the peak of a worker's interactive load. Before the replicas
    # reported their lines to each other, each took the other's lines for interactive
    # load and its peak held them for tens of seconds (4 + the other's lines: 11).
    # What a peak may still take for interactive: lines in transit. A line that ended
    # after a heartbeat was sampled, or that the other replica started before it was
    # sampled and has not reported yet (reports every 50 ms), is in the heartbeat's load
    # and not among the lines known. The peak counts a load once two heartbeats in a row
    # show it; with lines of ~0.2 s two heartbeats in a row sometimes had 2 such lines
    # (a peak of 6, in 2 of 10 runs), with lines of ~0.8 s once in 16 runs.
    most = await two_replicas_run_a_batch(fleet, decode_step_ms=40.0, hog=False)
    assert most["lines"] >= 6, most  # a worker's lines rose well above a heartbeat's swing
    # ... and neither replica's peak held them: 4 interactive, and lines in transit.
    assert most["peak"] <= 6, most


async def test_replicas_sharing_a_batch_share_each_workers_room(fleet: OpsFleet) -> None:
    # What all lines may hold on a worker: 16 less a quarter kept free, less the 4
    # interactive = 8. Before replicas told each other the models they hold lines for,
    # each filled the whole room before the other's lines showed in its reports or the
    # heartbeats: 10-11 lines on a worker here, up to 19 in longer runs under a hog. Each
    # now fills only its half. (The quarter is kept free after the load a heartbeat shows,
    # and lines started since its sample are not in it yet: with lines of ~0.8 s, one
    # replica alone also reaches 9-10 lines here, two 9-13.)
    most = await two_replicas_run_a_batch(fleet, decode_step_ms=10.0, hog=True)
    # More than one replica's half (4): both ran lines on one worker at once. Not the
    # whole room: with lines of ~0.2 s and starts every 50 ms (runner.DISPATCH_S), a slot
    # freed waits for the next start, so the room is ~80 % used and the most a worker
    # held at the test's samples (every 0.1 s, in the process the hog slows) was 6 in 6
    # of 8 runs (7 and 8 once each), 5 in CI (2026-12-07): a bound of 6 was the average.
    assert 5 <= most["lines"] <= 9, most


async def test_a_forged_heartbeat_cannot_make_a_replica_run_more_than_its_cap(
        fleet: OpsFleet) -> None:
    # Every worker's heartbeat claims 100,000 slots (a forger with Redis write access, or
    # a misconfigured agent): without batch.max_in_flight the runner would start all 40
    # lines at once. The simulators, not the router, count what reaches them.
    document = config(fleet)
    document["batch"]["max_in_flight"] = 4
    await fleet.start(WORKERS, config=document, decode_step_ms=10.0)
    for worker in WORKERS:
        await fleet.publish(worker, max_num_seqs=100_000)
    views = fleet.apps[0][HOLDER]
    await wait_for(lambda: all(view.heartbeat.capacity.max_num_seqs == 100_000
                               for view in views.current.workers.values()))
    peak = 0
    async with client(fleet.url) as openai, aiohttp.ClientSession() as http:
        created = await submit(openai, jsonl(40, max_tokens=20))
        deadline = time.monotonic() + 60
        while (batch := await openai.batches.retrieve(created.id)).status not in (
                "completed", "failed"):
            assert time.monotonic() < deadline, batch.request_counts
            seen = 0
            for sim in fleet.sims.values():
                async with http.get(f"{sim.url}/metrics") as response:
                    seen += parse_metrics(await response.text()).in_flight
            peak = max(peak, seen)
            await asyncio.sleep(0.02)
        status, document = await admin(fleet.url, "GET", "/admin/status")
    assert status == 200
    assert batch.status == "completed" and batch.request_counts is not None
    assert batch.request_counts.completed == 40
    assert 0 < peak <= 4, peak
    assert document["batches"]["here"]["max_in_flight"] == 4


async def test_a_cancelled_batch_keeps_what_ran_and_reports_the_rest(fleet: OpsFleet) -> None:
    # Slow answers (200 tokens, ~2 s each) so that cancelling finds most lines not yet run.
    await fleet.start(WORKERS, config=config(fleet), decode_step_ms=10.0)
    async with client(fleet.url) as openai:
        created = await submit(openai, jsonl(80, max_tokens=200))
        await until_status(openai, created.id, ("in_progress",))
        cancelling = await openai.batches.cancel(created.id)
        assert cancelling.status == "cancelling" and cancelling.cancelling_at
        done = await until_status(openai, created.id, ("cancelled",))
        output = await lines_of(openai, done.output_file_id)
        errors = await lines_of(openai, done.error_file_id)
        with pytest.raises(Exception, match=r"409|Cannot cancel"):
            await openai.batches.cancel(created.id)
    ids = [line["custom_id"] for line in output + errors]
    assert sorted(ids) == sorted(f"req-{i}" for i in range(80)), "each line exactly once"
    assert {line["error"]["code"] for line in errors} == {"batch_cancelled"}
    assert len(errors) > 40, "most lines had not run"


async def test_an_expired_batch_is_finalized_with_its_partial_results(fleet: OpsFleet) -> None:
    await fleet.start(WORKERS, config=config(fleet))
    for worker in WORKERS:  # no spare slot: nothing runs
        await fleet.publish(worker, running=8)
    async with client(fleet.url) as openai:
        created = await submit(openai, jsonl(5))
        await until_status(openai, created.id, ("in_progress",))
        # The 24 hours pass: the batch's deadline, moved to now in Redis.
        redis = connect(fleet.redis_url)
        key = BatchStore(redis, fleet.key_prefix).key(created.id)
        doc = json.loads(await redis.hget(key, "doc") or b"{}")
        await redis.hset(key, "doc", json.dumps({**doc, "expires_at": int(time.time())}))
        await redis.aclose()
        done = await until_status(openai, created.id, ("expired",))
        errors = await lines_of(openai, done.error_file_id)
    assert done.expired_at and done.output_file_id is None
    assert sorted(line["custom_id"] for line in errors) == [f"req-{i}" for i in range(5)]
    assert {line["error"]["code"] for line in errors} == {"batch_expired"}


async def test_a_tenant_sees_only_its_own_batches(fleet: OpsFleet, tmp_path: Path) -> None:
    await fleet.start(WORKERS, config=config(fleet, keys=True))
    async with client(fleet.url, KEYS["acme"]) as acme, \
            client(fleet.url, KEYS["other"]) as other:
        created = await submit(acme, jsonl(3))
        with pytest.raises(NotFoundError):
            await other.batches.retrieve(created.id)
        with pytest.raises(NotFoundError):
            await other.batches.cancel(created.id)
        assert [batch.id async for batch in other.batches.list()] == []
        assert [batch.id async for batch in acme.batches.list()] == [created.id]
        done = await until_status(acme, created.id, ("completed",))
        with pytest.raises(NotFoundError):
            await other.files.content(done.output_file_id)
        assert len(await lines_of(acme, done.output_file_id)) == 3
        # Another tenant's input file cannot be named either.
        theirs = await other.files.create(file=("x.jsonl", io.BytesIO(jsonl(1))),
                                          purpose="batch")
        with pytest.raises(Exception, match="No such File"):
            await acme.batches.create(input_file_id=theirs.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")


async def test_bad_create_requests_are_told_why(fleet: OpsFleet) -> None:
    await fleet.start(WORKERS, config=config(fleet))
    async with client(fleet.url) as openai:
        uploaded = await openai.files.create(file=("i.jsonl", io.BytesIO(jsonl(1))),
                                             purpose="batch")
        for changes, param in (({"endpoint": "/v1/nothing"}, "endpoint"),
                               ({"completion_window": "1h"}, "completion_window"),
                               ({"input_file_id": "file-nope"}, "input_file_id"),
                               ({"metadata": {"k": 1}}, "metadata")):
            body = {"input_file_id": uploaded.id, "endpoint": "/v1/chat/completions",
                    "completion_window": "24h", **changes}
            with pytest.raises(Exception) as refused:
                await openai.post("/batches", body=body, cast_to=object)
            assert getattr(refused.value, "status_code", None) == 400, refused.value
            assert getattr(refused.value, "body", {}).get("param") == param, refused.value
        with pytest.raises(NotFoundError):
            await openai.batches.retrieve("batch_" + "0" * 32)


async def globalpool(*args: str) -> tuple[int, str, str]:
    """`globalpool ARGS` as a user runs it: exit code, stdout, stderr."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router.cli", *args, cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    async with asyncio.timeout(120):
        out, err = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_the_batch_command_submits_follows_and_fetches(fleet: OpsFleet,
                                                             tmp_path: Path) -> None:
    await fleet.start(WORKERS, config=config(fleet))
    source = tmp_path / "requests.jsonl"
    source.write_bytes(jsonl(30, extra=[b"not json"]))
    results = tmp_path / "results"
    code, out, err = await globalpool("batch", "--router", fleet.url, "submit", str(source),
                                      "--metadata", "job=nightly", "--out", str(results))
    assert code == 0, err
    batch_id = out.strip()
    assert batch_id.startswith("batch_")
    assert "30/31 lines" in err or "31/31 lines" in err, err  # the progress bar
    output = (results / f"{batch_id}_output.jsonl").read_text().splitlines()
    errors = (results / f"{batch_id}_error.jsonl").read_text().splitlines()
    assert (len(output), len(errors)) == (30, 1)
    code, out, _ = await globalpool("batch", "--router", fleet.url, "list")
    assert code == 0 and f"{batch_id} completed: 30 completed, 1 failed of 31" in out
    code, _, err = await globalpool("batch", "--router", fleet.url, "cancel", batch_id)
    assert code == 1 and "Cannot cancel a batch with status 'completed'" in err
    code, _, err = await globalpool("batch", "--router", "http://127.0.0.1:9", "list")
    assert code == 1 and "cannot reach the router" in err


async def test_a_file_with_more_lines_than_a_batch_takes_is_refused_at_create(
        fleet: OpsFleet) -> None:
    document = config(fleet)
    document["batch"]["max_lines"] = 5
    await fleet.start(WORKERS, config=document)
    async with client(fleet.url) as openai:
        fits = await submit(openai, jsonl(5))
        assert fits.status == "validating"
        uploaded = await openai.files.create(file=("big.jsonl", io.BytesIO(jsonl(6))),
                                             purpose="batch")
        with pytest.raises(Exception) as refused:
            await openai.batches.create(input_file_id=uploaded.id,
                                        endpoint="/v1/chat/completions",
                                        completion_window="24h")
    assert getattr(refused.value, "status_code", None) == 400
    error = getattr(refused.value, "body", {})
    assert error.get("code") == "too_many_lines" and error.get("param") == "input_file_id"
    assert "6 lines" in error.get("message", "")


async def test_a_tenant_has_at_most_so_many_unfinished_batches(fleet: OpsFleet) -> None:
    document = config(fleet)
    document["batch"]["max_unfinished_per_tenant"] = 2
    await fleet.start(WORKERS, config=document)
    for worker in WORKERS:  # no spare slot: the batches stay unfinished
        await fleet.publish(worker, running=8)
    async with client(fleet.url) as openai:
        first = await submit(openai, jsonl(2))
        await submit(openai, jsonl(2))
        with pytest.raises(Exception) as refused:
            await submit(openai, jsonl(2))
        assert getattr(refused.value, "status_code", None) == 429
        assert getattr(refused.value, "body", {}).get("code") == "batch_limit_reached"
        await openai.batches.cancel(first.id)
        await until_status(openai, first.id, ("cancelled",))
        third = await submit(openai, jsonl(2))  # one ended: room for another
    assert third.status == "validating"


async def test_a_lease_ends_by_redis_clock_not_the_replicas(
        redis_url: str, key_prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A replica whose clock runs an hour ahead (a host without NTP) asks whether any lease
    # on a batch is still held: by its own clock the lease taken a moment ago has ended,
    # and it would finalize the batch while another replica still runs its lines.
    redis = connect(redis_url)
    store = BatchStore(redis, key_prefix)
    try:
        batch = await store.create({"id": "batch_clock", "owner": None,
                                    "created_at": int(time.time())})
        checked = check_input(jsonl(3), "/v1/chat/completions", 100)
        assert await store.validated(batch, checked, int(time.time()))
        _status, chunk, held = await store.claim(batch.id, "replica-a", 60_000)
        assert (chunk, held) == (0, 1)
        ahead = time.time() + 3600
        monkeypatch.setattr(time, "time", lambda: ahead)
        assert await store.leases_held(batch.id) == 1
    finally:
        await redis.aclose()
