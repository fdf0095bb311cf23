"""The Batch and Files APIs probed as an adversary would: the unchanged `openai` client and
raw HTTP against real router apps, a real Valkey and real simulators (the fleet of
tests.integration.operators_fleet), nothing of the project mocked. Each test asserts the
contract: OpenAI's shapes and behaviour, each input line answered exactly once, errors in
OpenAI's JSON format, tenants kept apart. Where a hostile input once stalled or miscounted
a batch, the test's comment says how.

The tests share one fleet and look only at their own batches and files; the two that look
at all a tenant has (paging, tenants) start a fleet of their own."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Final

import aiohttp
import pytest
import pytest_asyncio
from openai import AsyncOpenAI, NotFoundError

from lab.sim.config import SimConfig
from lab.sim.server import SimServer
from tests.integration.conftest import FAST
from tests.integration.operators_fleet import OpsFleet
from tests.integration.test_batches import (
    KEYS,
    WORKERS,
    client,
    config,
    jsonl,
    lines_of,
    submit,
    until_status,
)

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

ENDED = ("completed", "failed", "expired", "cancelled")
CHAT: Final = "/v1/chat/completions"


@contextlib.asynccontextmanager
async def started_fleet(redis_url: str, tmp_path: Path, *, keys: bool = False
                        ) -> AsyncIterator[OpsFleet]:
    """A fleet of its own (WORKERS, `config`; with tenant `keys` if asked): a fresh key
    prefix and files directory, simulators on this loop; all stopped on the way out."""
    async with contextlib.AsyncExitStack() as stack:

        async def start_sim(**changes: Any) -> SimServer:
            server = SimServer(SimConfig(**{**FAST, **changes}))
            await server.start()
            stack.push_async_callback(server.stop)
            return server

        fleet = OpsFleet(redis_url, f"gptest-{uuid.uuid4().hex[:10]}", tmp_path, start_sim)
        try:
            await fleet.start(WORKERS, config=config(fleet, keys=keys))
            yield fleet
        finally:
            await fleet.close()  # the routers first, then (the stack) the simulators


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shared_fleet(redis_url: str, tmp_path_factory: pytest.TempPathFactory
                       ) -> AsyncIterator[OpsFleet]:
    """The module's fleet, started once (the tests run on one event loop for it)."""
    async with started_fleet(redis_url, tmp_path_factory.mktemp("batch-adversary")) as fleet:
        yield fleet


@pytest_asyncio.fixture(loop_scope="module")
async def openai(shared_fleet: OpsFleet) -> AsyncIterator[AsyncOpenAI]:
    """A client of the module's fleet, every worker idle again (a test may have filled
    them) and its heartbeat fresh."""
    await set_running(shared_fleet, 0)
    async with client(shared_fleet.url) as opened:
        yield opened


async def set_running(fleet: OpsFleet, running: int) -> None:
    """Every worker reports `running` requests (8: no spare slot, no batch line starts)."""
    for worker in WORKERS:
        await fleet.publish(worker, running=running)


def row(custom_id: Any, *, model: str = "m", method: str = "POST", url: str = CHAT,
        **body: Any) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url,
                       "body": {"model": model, "max_tokens": 4,
                                "messages": [{"role": "user", "content": "hi"}], **body}}
                      ).encode()


async def upload(openai: AsyncOpenAI, data: bytes, purpose: Any = "batch") -> Any:
    return await openai.files.create(file=("input.jsonl", io.BytesIO(data)), purpose=purpose)


async def ended(openai: AsyncOpenAI, batch_id: str, timeout_s: float = 15.0) -> Any:
    """The batch once it has ended; fails, saying where it stayed, after `timeout_s`."""
    return await until_status(openai, batch_id, ENDED, timeout_s)


async def run(openai: AsyncOpenAI, data: bytes, timeout_s: float = 15.0
              ) -> tuple[Any, list[dict[str, Any]], list[dict[str, Any]]]:
    """`data` run as a batch: the batch once it has ended, its output and its error lines."""
    done = await ended(openai, (await submit(openai, data)).id, timeout_s)
    return (done, await lines_of(openai, done.output_file_id),
            await lines_of(openai, done.error_file_id))


async def refusal(method: str, url: str, data: bytes | None = None
                  ) -> tuple[int, dict[str, Any]]:
    """A raw HTTP request (`Content-Type: application/json`) that must be refused: its
    status and its `error` object, asserting that it is in OpenAI's format."""
    async with aiohttp.ClientSession() as http, http.request(
            method, url, data=data, headers={"Content-Type": "application/json"}) as response:
        body = await response.read()
        assert response.content_type == "application/json", (response.status, body[:200])
    error: dict[str, Any] = json.loads(body)["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    return response.status, error


async def listed(openai: AsyncOpenAI, page_size: int) -> list[str]:
    """The ids the client's auto-pagination lists, `page_size` a page (11 at the most)."""
    ids: list[str] = []
    async for batch in openai.batches.list(limit=page_size):
        ids.append(batch.id)
        if len(ids) > 10:
            break
    return ids


# --- listing and tenants (fleets of their own) -----------------------------------------


async def test_paging_through_batches_created_within_one_second_lists_each_once(
        redis_url: str, tmp_path: Path) -> None:
    # Four batches within milliseconds share a second; the client's auto-pagination
    # (`async for ... in batches.list(limit=...)`) lists each once. Before, `after` meant
    # "created before that batch's second", and the others of its second were skipped.
    async with started_fleet(redis_url, tmp_path) as fleet, client(fleet.url) as openai:
        await set_running(fleet, 8)  # nothing runs: only listing is exercised
        uploaded = await upload(openai, jsonl(1))
        created = [(await openai.batches.create(input_file_id=uploaded.id, endpoint=CHAT,
                                                completion_window="24h")).id
                   for _ in range(4)]
        by_one, by_two = await listed(openai, page_size=1), await listed(openai, page_size=2)
    assert sorted(by_one) == sorted(created), by_one
    assert sorted(by_two) == sorted(created), by_two


async def test_another_tenants_file_and_batch_cannot_be_reached(
        redis_url: str, tmp_path: Path) -> None:
    async with started_fleet(redis_url, tmp_path, keys=True) as fleet, \
            client(fleet.url, KEYS["acme"]) as acme, \
            client(fleet.url, KEYS["other"]) as other:
        created = await submit(acme, jsonl(3))
        done = await ended(acme, created.id)
        assert done.status == "completed" and done.output_file_id
        for file_id in (created.input_file_id, done.output_file_id):
            with pytest.raises(NotFoundError):
                await other.files.retrieve(file_id)
            with pytest.raises(NotFoundError):
                await other.files.content(file_id)
            with pytest.raises(NotFoundError):
                await other.files.delete(file_id)
            assert (await acme.files.retrieve(file_id)).id == file_id  # still there
        assert [f.id async for f in other.files.list()] == []
        with pytest.raises(Exception, match="No such File"):
            await other.batches.create(input_file_id=created.input_file_id, endpoint=CHAT,
                                       completion_window="24h")
        for call in (other.batches.retrieve, other.batches.cancel):
            with pytest.raises(NotFoundError):
                await call(created.id)
        assert (await other.batches.list(after=created.id)).data == []
        status, _ = await refusal("GET", fleet.url + "/v1/batches")
        assert status == 401
        # Cancelling a finished batch: 409, the batch unchanged.
        with pytest.raises(Exception, match=r"409|Cannot cancel"):
            await acme.batches.cancel(created.id)
        assert (await acme.batches.retrieve(created.id)).status == "completed"


# --- validating a file ---------------------------------------------------------------------


async def test_a_file_whose_every_line_is_faulty_ends_instead_of_running_for_24_hours(
        openai: AsyncOpenAI) -> None:
    # No line is runnable, so the batch has no model. It ends with the faults in its error
    # file (or failed); before, it went in_progress and waited there for 24 hours.
    done, _, errors = await run(openai, b"{broken\n" + row("g", method="GET") + b"\n")
    if done.status == "completed":
        assert sorted((e["custom_id"] or "", e["error"]["code"]) for e in errors) == [
            ("", "invalid_json_line"), ("g", "invalid_method")]
    else:
        assert done.status == "failed" and done.errors is not None


async def test_a_deeply_nested_line_is_a_line_error_not_a_batch_stuck_validating(
        openai: AsyncOpenAI) -> None:
    # json.loads raises RecursionError (not a ValueError) on deep nesting: that line is
    # faulty, the others run. Before, validation died on it each time it was tried.
    deep = (b'{"custom_id": "deep", "method": "POST", "url": "/v1/chat/completions", '
            b'"body": {"model": "m", "messages": [], "metadata": '
            + b"[" * 50_000 + b"]" * 50_000 + b"}}")
    done, output, errors = await run(openai, jsonl(2) + deep + b"\n")
    assert done.status == "completed", (done.status, done.errors)
    assert sorted(line["custom_id"] for line in output) == ["req-0", "req-1"]
    assert [line["error"]["code"] for line in errors] == ["invalid_json_line"]


async def test_a_custom_id_is_unique_across_the_file_faulty_lines_included(
        openai: AsyncOpenAI) -> None:
    # A faulty line that reuses a running line's custom_id is caught too, so that every
    # result can be matched to its request by custom_id.
    data = b"\n".join([row("a"), row("a", method="GET"), row("b"), row("b", stream=True)])
    done, output, errors = await run(openai, data + b"\n")
    if done.status == "failed":
        assert done.errors is not None
        assert "duplicate_custom_id" in {error.code for error in done.errors.data}
    else:
        ids = [line["custom_id"] for line in output + errors]
        assert len(ids) == len(set(ids)), f"custom_ids answered twice: {sorted(ids)}"


async def test_a_file_fault_names_the_line_of_the_file_blank_lines_counted(
        openai: AsyncOpenAI) -> None:
    # The duplicate stands on line 3 of the file, after a blank line: that is the line
    # named (before, blank lines were skipped before numbering, and it was "line 2").
    done, _, _ = await run(openai, row("a") + b"\n\n" + row("a") + b"\n")
    assert done.status == "failed" and done.errors is not None
    assert [(e.code, e.line) for e in done.errors.data] == [("duplicate_custom_id", 3)]


async def test_odd_lines_each_get_their_error_and_the_good_ones_run(
        openai: AsyncOpenAI) -> None:
    rows = [
        b"\xef\xbb\xbf" + row("bom") + b"\r\n",  # a BOM, CRLF line endings
        row("crlf") + b"\r\n",
        b"\r\n",  # a blank line (CRLF)
        b'{"custom_id": "u", "x": "\xff\xfe"}\n',  # not UTF-8
        row("s", stream=True) + b"\n",
        json.dumps({"custom_id": "b", "method": "POST", "url": CHAT, "body": []}).encode()
        + b"\n",
        row("g", method="GET") + b"\n",
        row(5) + b"\n",
        row("x" * 513) + b"\n",
        json.dumps({"custom_id": "nm", "method": "POST", "url": CHAT,
                    "body": {"messages": []}}).encode() + b"\n",
        b"[1, 2]\n",
    ]
    done, output, errors = await run(openai, b"".join(rows))
    assert done.status == "completed", done.errors
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed,
            done.request_counts.failed) == (10, 2, 8)
    assert sorted(line["custom_id"] for line in output) == ["bom", "crlf"]
    assert sorted((line["custom_id"] or "", line["error"]["code"]) for line in errors) == [
        ("", "invalid_json_line"), ("", "invalid_json_line"),
        ("", "missing_required_parameter"), ("", "missing_required_parameter"),
        ("b", "missing_required_parameter"), ("g", "invalid_method"),
        ("nm", "missing_required_parameter"), ("s", "invalid_request")]
    assert len({line["id"] for line in output + errors}) == 10


@pytest.mark.parametrize("data", [b"", b"\n\n \r\n\t\n"], ids=["empty", "blank-lines"])
async def test_a_file_without_requests_fails_validation(openai: AsyncOpenAI,
                                                        data: bytes) -> None:
    done, _, _ = await run(openai, data)
    assert done.status == "failed" and done.errors is not None
    assert [e.code for e in done.errors.data] == ["empty_file"]
    assert done.output_file_id is None and done.error_file_id is None


async def test_a_line_for_another_endpoint_fails_validation(openai: AsyncOpenAI) -> None:
    data = row("a") + b"\n" + row("b", url="/v1/completions") + b"\n" + row("c", model="n")
    done, _, _ = await run(openai, data + b"\n")
    assert done.status == "failed" and done.errors is not None
    assert [(e.code, e.line) for e in done.errors.data] == [
        ("invalid_url", 2), ("mismatched_model", 3)]


# --- running, cancelling, deleting -----------------------------------------------------


async def test_a_batch_for_a_model_nobody_serves_ends_with_model_not_found(
        openai: AsyncOpenAI) -> None:
    # A line starts only into a spare slot of a worker serving its model. A model that no
    # worker serves and regions.yaml does not list has none, ever: its lines end with a 404
    # in the error file within seconds, as an interactive request gets model_not_found at
    # once (and as OpenAI writes it). Before, the batch sat in_progress until it expired.
    data = row("x1", model="no-such-model") + b"\n" + row("x2", model="no-such-model") + b"\n"
    done, _, errors = await run(openai, data, timeout_s=20.0)
    assert done.status in ("completed", "failed"), done.status
    if done.status == "completed":
        assert sorted(line["custom_id"] for line in errors) == ["x1", "x2"]
        assert all(line["response"]["status_code"] == 404 for line in errors), errors


async def test_cancelling_twice_and_a_validating_batch(shared_fleet: OpsFleet,
                                                       openai: AsyncOpenAI) -> None:
    await set_running(shared_fleet, 8)
    created = await submit(openai, jsonl(3))
    first = await openai.batches.cancel(created.id)
    assert first.status in ("cancelling", "cancelled")
    with pytest.raises(Exception, match=r"409|Cannot cancel"):
        await openai.batches.cancel(created.id)
    done = await ended(openai, created.id)
    errors = await lines_of(openai, done.error_file_id)
    assert done.status == "cancelled" and done.cancelled_at
    ids = sorted(line["custom_id"] for line in errors)
    assert ids in ([], ["req-0", "req-1", "req-2"]), ids


async def test_files_odd_uploads_and_deleted_inputs(shared_fleet: OpsFleet,
                                                    openai: AsyncOpenAI) -> None:
    await set_running(shared_fleet, 8)
    for purpose in ("batch_output", "nope", ""):
        with pytest.raises(Exception) as refused:
            await upload(openai, jsonl(1), purpose=purpose)
        assert getattr(refused.value, "status_code", None) == 400, purpose
    named = await openai.files.create(
        file=("../../etc/\x07passwd.jsonl", io.BytesIO(jsonl(1))), purpose="batch")
    assert named.filename.endswith("passwd.jsonl"), named.filename
    assert "/" not in named.filename and "\x07" not in named.filename, named.filename
    # The input file of a batch that has not run yet is deleted: every line still ends
    # up exactly once, in the output or the error file.
    created = await submit(openai, jsonl(20))
    while (await openai.batches.retrieve(created.id)).status == "validating":  # noqa: ASYNC110
        await asyncio.sleep(0.1)
    await openai.files.delete(created.input_file_id)
    with pytest.raises(NotFoundError):
        await openai.files.content(created.input_file_id)
    await set_running(shared_fleet, 0)
    done = await ended(openai, created.id)
    output = await lines_of(openai, done.output_file_id)
    errors = await lines_of(openai, done.error_file_id)
    assert len(output) + len(errors) == 20
    assert len({line["id"] for line in output + errors}) == 20


# --- the API's requests ------------------------------------------------------------------


async def test_a_deeply_nested_create_body_is_a_400_in_openai_format(
        shared_fleet: OpsFleet) -> None:
    # The RecursionError of deep nesting, in POST /v1/batches' own body: a 400 in OpenAI's
    # format (before, aiohttp's plain-text 500).
    body = (b'{"endpoint": "/v1/chat/completions", "completion_window": "24h", '
            b'"input_file_id": "file-x", "metadata": ' + b"[" * 25_000 + b"]" * 25_000 + b"}")
    status, error = await refusal("POST", shared_fleet.url + "/v1/batches", body)
    assert status == 400, error


async def test_bad_create_and_list_requests_are_400s_naming_the_param(
        shared_fleet: OpsFleet, openai: AsyncOpenAI) -> None:
    await set_running(shared_fleet, 8)
    uploaded = await upload(openai, jsonl(1))
    other = await upload(openai, jsonl(1), purpose="fine-tune")
    good: dict[str, Any] = {"input_file_id": uploaded.id, "endpoint": CHAT,
                            "completion_window": "24h"}
    refusals: list[tuple[dict[str, Any], str]] = [
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k" * 65: "v"}}, "metadata"),
        ({"metadata": {"k": "v" * 513}}, "metadata"),
        ({"metadata": ["k", "v"]}, "metadata"),
        ({"completion_window": "48h"}, "completion_window"),
        ({"completion_window": None}, "completion_window"),
        ({"endpoint": "/v1/models"}, "endpoint"),
        ({"endpoint": "/v1/chat/completions/"}, "endpoint"),
        ({"input_file_id": other.id}, "input_file_id"),
        ({"input_file_id": "file-" + "A" * 24}, "input_file_id"),
        ({"input_file_id": 7}, "input_file_id"),
    ]
    for changes, param in refusals:
        with pytest.raises(Exception) as refused:
            await openai.post("/batches", body={**good, **changes}, cast_to=object)
        assert getattr(refused.value, "status_code", None) == 400, (changes, refused.value)
        assert getattr(refused.value, "body", {}).get("param") == param, refused.value
    at_limits = await openai.batches.create(
        **good, metadata={f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)})
    assert at_limits.metadata is not None and len(at_limits.metadata) == 16
    await openai.batches.cancel(at_limits.id)  # nothing of this test's runs after it
    for limit in ("0", "101", "x", "-1"):
        status, error = await refusal("GET", f"{shared_fleet.url}/v1/batches?limit={limit}")
        assert status == 400 and error["param"] == "limit", (limit, error)
    page = await openai.batches.list(after="batch_" + "0" * 32)
    assert page.data == []
    with pytest.raises(NotFoundError):
        await openai.batches.retrieve("batch_" + "x" * 100)


async def test_raw_http_errors_are_openai_json(shared_fleet: OpsFleet) -> None:
    cases = [
        ("GET", "/v1/batches/batch_x/cancel", None, 405),
        ("DELETE", "/v1/batches/batch_x", None, 405),
        ("POST", "/v1/batches", b"not json", 400),
        ("POST", "/v1/batches", b"[]", 400),
        ("POST", "/v1/batches", b"null", 400),
        ("POST", "/v1/batches", b"{" + b" " * (70 * 1024) + b"}", 413),
        ("POST", "/v1/files", b"{}", 400),
        ("GET", "/v1/files/file-..%2F..%2Fetc/content", None, 404),
        ("GET", "/v1/files?limit=0", None, 400),
        ("GET", "/v1/files?after=file-nope", None, 400),
    ]
    for method, path, data, expected in cases:
        status, error = await refusal(method, shared_fleet.url + path, data)
        assert status == expected, (method, path, status, error)
        assert "127.0.0.1" not in error["message"], error
