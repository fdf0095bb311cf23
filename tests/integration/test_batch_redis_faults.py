"""The Batch and Files APIs when Redis or the blob store misbehave as a real deployment's
do: Redis emptied (FLUSHALL, or restarted without its data) mid-batch, Redis hung
(SIGSTOP) or killed and back with its data, Redis full (maxmemory), the files directory
gone or replaced while a batch finalizes, an input file deleted while its batch runs.

Each test has a Valkey of its own (a real process the test stops, kills, restarts on the
same port or fills), real router apps (tests.integration.operators_fleet) and real
simulators, driven by the unchanged `openai` client and by raw HTTP. Agents' heartbeats
are published every half second, as worker agents do, so that an emptied Redis is
repopulated with the fleet as it would be in production.

What a production user would call a bug is asserted as the correct behaviour and marked
`xfail(strict=True)` with the reason; what already behaves is a plain test."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import shutil
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI, NotFoundError
from prometheus_client.parser import text_string_to_metric_families

from lab.devstack.valkey import EmbeddedValkey, free_port
from tests.conftest import skip_unless_slow_tests_are_asked_for
from tests.integration.conftest import StartSim
from tests.integration.operators_fleet import OpsFleet, wait_for
from tests.integration.test_batches import WORKERS, client, config, jsonl, lines_of, submit
from worker.engine_metrics import parse_metrics
from worker.redis_client import connect

# The slow tier (`pytest -m slow`): ~55 s of Valkey processes killed, frozen and filled,
# which the default run's 15 minutes cannot spare.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(60)]


@pytest.fixture(autouse=True)
def _slow_tier(request: pytest.FixtureRequest) -> None:
    skip_unless_slow_tests_are_asked_for(request.config, "Valkey killed, frozen and "
                                                         "filled, ~55 s in all")

ENDED = ("completed", "failed", "expired", "cancelled")
LINE_TOKENS = 20  # ~0.2 s a line at 10 ms a decode step


class Valkey:
    """A Valkey of the test's own on a fixed port: stopped (SIGSTOP), killed, restarted
    on that port with its data (an append-only file, fsynced always) or empty."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.server: EmbeddedValkey | None = None
        self.paused = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, *, empty: bool = False) -> None:
        if empty:
            shutil.rmtree(self.workdir, ignore_errors=True)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.server = EmbeddedValkey.start(
            port=self.port, workdir=self.workdir,
            extra_args=["--appendonly", "yes", "--appendfsync", "always"])

    def kill(self) -> None:
        """SIGKILL, reaped: connections are refused until `start`."""
        assert self.server is not None
        self.resume()
        self.server.process.kill()
        self.server.process.wait(10)
        self.server = None

    def pause(self) -> None:
        """SIGSTOP: connections open, nothing answered (a hung or partitioned Redis)."""
        assert self.server is not None
        os.kill(self.server.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        if self.server is not None and self.paused:
            os.kill(self.server.pid, signal.SIGCONT)
        self.paused = False

    def command(self, *words: str) -> Any:
        assert self.server is not None
        return self.server.command(*words)

    def stop(self) -> None:
        self.resume()
        if self.server is not None:
            self.server.stop()
            self.server = None


@pytest.fixture
def valkey(tmp_path: Path) -> Iterator[Valkey]:
    server = Valkey(tmp_path / "valkey")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def batch_fleet(valkey: Valkey, tmp_path: Path, start_sim: StartSim
                      ) -> AsyncIterator[OpsFleet]:
    """One router app on `valkey`, three simulators (~0.2 s a line), the fixed quarter
    reserve (18 lines at once: predictable), heartbeats published every 0.5 s."""
    fleet = OpsFleet(valkey.url, f"gptest-{os.urandom(5).hex()}", tmp_path, start_sim)

    async def agents() -> None:
        while True:
            for worker in WORKERS:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(2.0):
                        await fleet.publish(worker)
            await asyncio.sleep(0.5)

    beating: asyncio.Task[None] | None = None
    try:
        document = config(fleet)
        document["batch"]["interactive_reserve"] = 0.25
        await fleet.start(WORKERS, config=document, decode_step_ms=10.0)
        beating = asyncio.create_task(agents())
        yield fleet
    finally:
        if beating is not None:
            beating.cancel()
            await asyncio.gather(beating, return_exceptions=True)
        valkey.resume()
        await fleet.close()


# --- helpers --------------------------------------------------------------------------
def blobs(fleet: OpsFleet) -> set[str]:
    """The file contents in the fleet's blob store (`files/<id>`)."""
    directory = fleet.tmp_path / "files" / "files"
    return {path.name for path in directory.iterdir()} if directory.is_dir() else set()


async def done_lines(openai: AsyncOpenAI, batch_id: str, at_least: int,
                     timeout_s: float = 15.0) -> Any:
    """The batch once `at_least` of its lines are done (it must still be running)."""
    deadline = time.monotonic() + timeout_s
    while True:
        batch = await openai.batches.retrieve(batch_id)
        counts = batch.request_counts
        if counts is not None and counts.completed + counts.failed >= at_least:
            assert batch.status == "in_progress", batch
            return batch
        assert batch.status not in ENDED, batch
        assert time.monotonic() < deadline, (batch.status, counts)
        await asyncio.sleep(0.05)


async def ended(openai: AsyncOpenAI, batch_id: str, timeout_s: float = 20.0) -> Any:
    """The batch once it has ended; fails, saying where it stayed, after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        batch = await openai.batches.retrieve(batch_id)
        if batch.status in ENDED:
            return batch
        assert time.monotonic() < deadline, (batch.status, batch.request_counts)
        await asyncio.sleep(0.1)


async def answered(fleet: OpsFleet) -> int:
    """Requests the simulators have answered in all (their own count, vLLM's metric)."""
    total = 0.0
    async with aiohttp.ClientSession() as http:
        for sim in fleet.sims.values():
            async with http.get(f"{sim.url}/metrics") as response:
                text = await response.text()
            for family in text_string_to_metric_families(text):
                if family.name == "vllm:request_success":
                    total += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return int(total)


async def in_flight(fleet: OpsFleet) -> int:
    """Requests the simulators are serving now."""
    total = 0
    async with aiohttp.ClientSession() as http:
        for sim in fleet.sims.values():
            async with http.get(f"{sim.url}/metrics") as response:
                total += parse_metrics(await response.text()).in_flight
    return total


async def exactly_once(openai: AsyncOpenAI, batch: Any, count: int) -> None:
    """Every `req-<i>` of the batch in its output or error file, exactly once."""
    lines = (await lines_of(openai, batch.output_file_id)
             + await lines_of(openai, batch.error_file_id))
    ids = [line["custom_id"] for line in lines]
    assert sorted(ids) == sorted(f"req-{i}" for i in range(count)), (
        f"{len(ids)} entries, {len(set(ids))} distinct, of {count} lines")


def form(data: bytes = b"{}\n") -> aiohttp.FormData:
    upload = aiohttp.FormData()
    upload.add_field("purpose", "batch")
    upload.add_field("file", io.BytesIO(data), filename="input.jsonl")
    return upload


async def refused(url: str, method: str, path: str, *, redis_port: int | None = None,
                  **kwargs: Any) -> tuple[int, dict[str, Any]]:
    """A request made while Redis or the storage is down: its status and `error`,
    asserted to be in OpenAI's format and to name no internal address, path or trace."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as http, \
            http.request(method, url + path, **kwargs) as response:
        text = await response.text()
        status, content_type = response.status, response.headers.get("Content-Type", "")
        retry_after = response.headers.get("Retry-After")
    assert content_type.startswith("application/json"), (method, path, status, text[:300])
    assert "Traceback" not in text, text[:500]
    assert redis_port is None or f":{redis_port}" not in text, text[:500]
    assert "redis" not in text.lower() and "/tmp" not in text, text[:500]
    error = json.loads(text)["error"]
    assert isinstance(error["message"], str) and isinstance(error["type"], str), error
    if status == 503:
        assert retry_after is not None, (method, path)
    return status, error


# --- 1. Redis emptied under a running batch ----------------------------------------------
async def test_a_batch_lost_with_an_emptied_redis_is_a_clean_404_and_the_router_goes_on(
        batch_fleet: OpsFleet, valkey: Valkey) -> None:
    # Redis restarted without its data (no persistence, a failover to an empty replica):
    # the batch's state is gone. Its client gets OpenAI's 404, never a 500; the router
    # neither crashes nor spins, and takes a new batch at once.
    async with client(batch_fleet.url) as openai:
        created = await submit(openai, jsonl(200, max_tokens=LINE_TOKENS))
        await done_lines(openai, created.id, 20)
        assert valkey.command("FLUSHALL") == "OK"
        cpu = time.process_time()
        await asyncio.sleep(3.0)
        used = time.process_time() - cpu
        with pytest.raises(NotFoundError) as lost:
            await openai.batches.retrieve(created.id)
        assert lost.value.status_code == 404
        body = lost.value.body
        assert isinstance(body, dict) and isinstance(body.get("message"), str), body
        listed = await openai.batches.list()
        assert [batch.id for batch in listed.data] == []
        again = await submit(openai, jsonl(20, max_tokens=LINE_TOKENS))
        done = await ended(openai, again.id)
        assert done.status == "completed", done
        await exactly_once(openai, done, 20)
    # Lines still ran for a moment (those in flight), then nothing: ~0.2 s of CPU a
    # second for a handful of lines, not a core.
    assert used < 2.0, f"{used:.2f} s of CPU in the 3 s after the flush"


async def test_lines_that_end_after_redis_was_emptied_leave_no_keys_behind(
        batch_fleet: OpsFleet, valkey: Valkey) -> None:
    async with client(batch_fleet.url) as openai:
        created = await submit(openai, jsonl(200, max_tokens=100))  # ~1 s a line
        await wait_for(lambda: in_flight(batch_fleet), timeout_s=10)
        assert valkey.command("FLUSHALL") == "OK"
        await asyncio.sleep(2.5)  # the lines in flight end; the leases' renewal fails
    redis = connect(valkey.url)
    try:
        left = [key async for key in redis.scan_iter(match=f"*{{{created.id}}}*")]
    finally:
        await redis.aclose()
    assert left == [], f"orphaned keys of the lost batch: {sorted(left)}"


async def test_a_finished_batchs_output_survives_redis_restarting_empty(
        batch_fleet: OpsFleet, valkey: Valkey) -> None:
    async with client(batch_fleet.url) as openai:
        created = await submit(openai, jsonl(10, max_tokens=2))
        done = await ended(openai, created.id)
        assert done.status == "completed" and done.output_file_id
        before = blobs(batch_fleet)
        valkey.kill()
        valkey.start(empty=True)
        await asyncio.sleep(1.0)
        assert blobs(batch_fleet) == before, "the bytes are still in the blob store"
        content = await openai.files.content(done.output_file_id)
    assert len(content.text.splitlines()) == 10


# --- 2. Redis hung, then back with its data ----------------------------------------------
async def test_a_hung_redis_mid_batch_gets_503s_and_the_batch_then_finishes_exactly_once(
        batch_fleet: OpsFleet, valkey: Valkey) -> None:
    url = batch_fleet.url
    async with client(url) as openai:
        created = await submit(openai, jsonl(150, max_tokens=LINE_TOKENS))
        finished = await submit(openai, jsonl(2, max_tokens=2))
        await done_lines(openai, created.id, 20)
        old = await ended(openai, finished.id)
        valkey.pause()
        try:
            started = time.monotonic()
            answers = await asyncio.gather(
                refused(url, "POST", "/v1/files", data=form(), redis_port=valkey.port),
                refused(url, "POST", "/v1/batches", redis_port=valkey.port, json={
                    "input_file_id": created.input_file_id, "completion_window": "24h",
                    "endpoint": "/v1/chat/completions"}),
                refused(url, "GET", f"/v1/batches/{created.id}", redis_port=valkey.port),
                refused(url, "GET", "/v1/batches", redis_port=valkey.port),
                refused(url, "POST", f"/v1/batches/{created.id}/cancel",
                        redis_port=valkey.port),
                refused(url, "GET", "/v1/files", redis_port=valkey.port),
                refused(url, "GET", f"/v1/files/{old.output_file_id}/content",
                        redis_port=valkey.port),
                refused(url, "DELETE", f"/v1/files/{old.output_file_id}",
                        redis_port=valkey.port))
            waited = time.monotonic() - started
            assert [status for status, _ in answers] == [503] * len(answers), answers
            assert waited < 8.0, f"the 503s took {waited:.1f} s"
            await asyncio.sleep(max(0.0, 6.0 - waited))
        finally:
            valkey.resume()
        done = await ended(openai, created.id, timeout_s=30)
        assert done.status == "completed", done
        await exactly_once(openai, done, 150)
        listed = await openai.batches.list()
        assert {batch.id for batch in listed.data} == {created.id, finished.id}, (
            "no batch half-created while Redis hung")
        assert len(await lines_of(openai, old.output_file_id)) == 2, "not deleted"


async def test_a_line_whose_result_cannot_be_recorded_is_not_run_again(
        batch_fleet: OpsFleet, valkey: Valkey) -> None:
    # Redis full (maxmemory reached, noeviction: writes refused with OOM, reads served)
    # for 4 s, then room again. The simulators count what reaches them.
    async with client(batch_fleet.url) as openai:
        created = await submit(openai, jsonl(120, max_tokens=LINE_TOKENS))
        await done_lines(openai, created.id, 20)
        assert valkey.command("CONFIG", "SET", "maxmemory", "1") == "OK"
        try:
            await asyncio.sleep(4.0)
            stuck = await openai.batches.retrieve(created.id)
            assert stuck.status == "in_progress", "reads still served"
        finally:
            assert valkey.command("CONFIG", "SET", "maxmemory", "0") == "OK"
        done = await ended(openai, created.id, timeout_s=30)
        assert done.status == "completed", done
        await exactly_once(openai, done, 120)
    sent = await answered(batch_fleet)
    assert sent <= 120 + 18, f"{sent} requests reached the workers for 120 lines"


# --- 3. Redis down at create time, killed mid-batch and back with its data ----------------
async def test_redis_killed_mid_batch_and_back_with_its_data(
        batch_fleet: OpsFleet, valkey: Valkey) -> None:
    # Killed: connections refused at once (not hung). An upload, a create, a retrieve,
    # a list are OpenAI 503s at once; the upload's bytes are not left in the store; no
    # batch is half-created; back with its data (AOF), the batch resumes and ends with
    # every line once.
    url = batch_fleet.url
    async with client(url) as openai:
        created = await submit(openai, jsonl(150, max_tokens=LINE_TOKENS))
        await done_lines(openai, created.id, 20)
        stored = blobs(batch_fleet)
        valkey.kill()
        try:
            started = time.monotonic()
            answers = await asyncio.gather(
                refused(url, "POST", "/v1/files", data=form(jsonl(3)),
                        redis_port=valkey.port),
                refused(url, "POST", "/v1/batches", redis_port=valkey.port, json={
                    "input_file_id": created.input_file_id, "completion_window": "24h",
                    "endpoint": "/v1/chat/completions"}),
                refused(url, "GET", f"/v1/batches/{created.id}", redis_port=valkey.port),
                refused(url, "GET", "/v1/batches", redis_port=valkey.port),
                refused(url, "GET", f"/v1/files/{created.input_file_id}",
                        redis_port=valkey.port))
            assert [status for status, _ in answers] == [503] * len(answers), answers
            assert time.monotonic() - started < 5.0
            assert blobs(batch_fleet) == stored, "the refused upload's bytes are gone"
            await asyncio.sleep(4.0)
        finally:
            valkey.start()
        done = await ended(openai, created.id, timeout_s=30)
        assert done.status == "completed", done
        await exactly_once(openai, done, 150)
        listed = await openai.batches.list()
        assert [batch.id for batch in listed.data] == [created.id]
        files = await openai.files.list()
        assert sorted(file.purpose for file in files.data) == ["batch", "batch_output"]


# --- 4. The blob store -----------------------------------------------------------------
async def test_storage_gone_while_a_batch_finalizes_holds_it_until_storage_is_back(
        batch_fleet: OpsFleet) -> None:
    # The files directory replaced by a plain file (an unmounted volume, a full or
    # read-only disk: root ignores a read-only mode, so a file stands in): the batch
    # cannot write its output. It waits in `finalizing`, the Files API answers 503 in
    # OpenAI's format; once storage is back the batch completes with one output file.
    directory = batch_fleet.tmp_path / "files"
    aside = batch_fleet.tmp_path / "files-aside"
    async with client(batch_fleet.url) as openai:
        created = await submit(openai, jsonl(40, max_tokens=LINE_TOKENS))
        await done_lines(openai, created.id, 5)
        directory.rename(aside)
        directory.write_text("not a directory")
        try:
            deadline = time.monotonic() + 15
            while (batch := await openai.batches.retrieve(created.id)).status != "finalizing":
                assert batch.status == "in_progress", batch
                assert time.monotonic() < deadline, batch
                await asyncio.sleep(0.1)
            await asyncio.sleep(3.0)  # more than a lease: finalization tried again
            assert (await openai.batches.retrieve(created.id)).status == "finalizing"
            status, error = await refused(
                batch_fleet.url, "GET", f"/v1/files/{created.input_file_id}/content")
            assert status == 503, error
        finally:
            directory.unlink()
            aside.rename(directory)
        done = await ended(openai, created.id)
        assert done.status == "completed", done
        await exactly_once(openai, done, 40)
        files = await openai.files.list(purpose="batch_output")
        assert [file.id for file in files.data] == [done.output_file_id]


async def test_an_input_file_deleted_while_its_batch_runs(batch_fleet: OpsFleet) -> None:
    # OpenAI lets a user delete a running batch's input file. The batch still ends, and
    # each of its lines is in its output or error file once.
    async with client(batch_fleet.url) as openai:
        created = await submit(openai, jsonl(100, max_tokens=LINE_TOKENS))
        await done_lines(openai, created.id, 10)
        deleted = await openai.files.delete(created.input_file_id)
        assert deleted.deleted
        done = await ended(openai, created.id)
        assert done.status in ("completed", "failed"), done
        await exactly_once(openai, done, 100)



async def test_storage_emptied_while_a_batch_runs(batch_fleet: OpsFleet) -> None:
    # The files directory removed under a running batch (a volume remounted empty): the
    # batch, whose input was read at validation, completes and its output is readable;
    # the input file, its record still in Redis, answers an OpenAI error, not a trace.
    async with client(batch_fleet.url) as openai:
        created = await submit(openai, jsonl(60, max_tokens=LINE_TOKENS))
        await done_lines(openai, created.id, 5)
        shutil.rmtree(batch_fleet.tmp_path / "files")
        done = await ended(openai, created.id)
        assert done.status == "completed", done
        await exactly_once(openai, done, 60)
        status, error = await refused(batch_fleet.url, "GET",
                                      f"/v1/files/{created.input_file_id}/content")
        assert (status, error["code"]) == (500, "file_content_missing"), error
