"""The Batch and Files APIs probed as an adversary would: the unchanged `openai` client and
raw HTTP against real router apps, a real Valkey and real simulators (the fleet of
tests.integration.operators_fleet), nothing of the project mocked.

A test here asserts the contract (OpenAI's shapes and behaviour, each input line answered
exactly once, errors in OpenAI's JSON format, tenants apart); those that fail on today's
code show a bug, the others pin down what held."""

from __future__ import annotations

import asyncio
import io
import json
import time
from typing import Any, Final

import aiohttp
import pytest
from openai import AsyncOpenAI, NotFoundError

from tests.integration.operators_fleet import OpsFleet
from tests.integration.test_batches import KEYS, WORKERS, client, config, jsonl, lines_of

pytestmark = pytest.mark.integration

ENDED = ("completed", "failed", "expired", "cancelled")
CHAT: Final = "/v1/chat/completions"


def row(custom_id: Any, *, model: str = "m", method: str = "POST", url: str = CHAT,
        **body: Any) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url,
                       "body": {"model": model, "max_tokens": 4,
                                "messages": [{"role": "user", "content": "hi"}], **body}}
                      ).encode()


async def upload(openai: AsyncOpenAI, data: bytes, purpose: Any = "batch") -> Any:
    return await openai.files.create(file=("input.jsonl", io.BytesIO(data)), purpose=purpose)


async def create(openai: AsyncOpenAI, data: bytes) -> Any:
    uploaded = await upload(openai, data)
    return await openai.batches.create(input_file_id=uploaded.id, endpoint=CHAT,
                                       completion_window="24h")


async def ended(openai: AsyncOpenAI, batch_id: str, timeout_s: float = 15.0) -> Any:
    """The batch once it has ended; fails, saying where it stayed, after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        batch = await openai.batches.retrieve(batch_id)
        if batch.status in ENDED:
            return batch
        assert time.monotonic() < deadline, (
            f"batch still {batch.status!r} after {timeout_s} s", batch.request_counts)
        await asyncio.sleep(0.2)


async def raw(method: str, url: str, *, data: bytes | None = None,
              headers: dict[str, str] | None = None) -> tuple[int, str, bytes]:
    async with aiohttp.ClientSession() as http, http.request(
            method, url, data=data, headers=headers) as response:
        return response.status, response.content_type, await response.read()


def openai_error(status: int, content_type: str, body: bytes) -> dict[str, Any]:
    """The body's `error` object, asserting it is OpenAI's format."""
    assert content_type == "application/json", (status, content_type, body[:200])
    error: dict[str, Any] = json.loads(body)["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    return error


# --- bugs ---------------------------------------------------------------------------------


async def test_paging_through_batches_created_within_one_second_lists_each_once(
        fleet: OpsFleet) -> None:
    # `after` is turned into "created strictly before that batch's second": every other
    # batch of the same second (a script submitting several) is skipped, and the client's
    # auto-pagination (`async for ... in batches.list(limit=...)`) never sees it.
    await fleet.start(WORKERS, config=config(fleet))
    for worker in WORKERS:  # no spare slot: nothing runs, only listing is exercised
        await fleet.publish(worker, running=8)
    async with client(fleet.url) as openai:
        uploaded = await upload(openai, jsonl(1))
        created = []
        for _ in range(4):  # four within milliseconds: at least two share a second
            batch = await openai.batches.create(input_file_id=uploaded.id, endpoint=CHAT,
                                                completion_window="24h")
            created.append(batch.id)
        listed: list[str] = []
        async for batch in openai.batches.list(limit=1):
            listed.append(batch.id)
            if len(listed) > 10:
                break
        by_two: list[str] = []
        async for batch in openai.batches.list(limit=2):
            by_two.append(batch.id)
            if len(by_two) > 10:
                break
    assert sorted(listed) == sorted(created), listed
    assert sorted(by_two) == sorted(created), by_two


async def test_a_file_whose_every_line_is_faulty_ends_instead_of_running_for_24_hours(
        fleet: OpsFleet) -> None:
    # Validation finds no runnable line: the batch goes in_progress with model None, and
    # the runner never claims a chunk of a batch without a model, so it never finalizes.
    await fleet.start(WORKERS, config=config(fleet))
    data = b"{broken\n" + row("g", method="GET") + b"\n"
    async with client(fleet.url) as openai:
        created = await create(openai, data)
        done = await ended(openai, created.id)
        errors = await lines_of(openai, done.error_file_id)
    if done.status == "completed":
        assert sorted((e["custom_id"] or "", e["error"]["code"]) for e in errors) == [
            ("", "invalid_json_line"), ("g", "invalid_method")]
    else:
        assert done.status == "failed" and done.errors is not None


async def test_a_deeply_nested_line_is_a_line_error_not_a_batch_stuck_validating(
        fleet: OpsFleet) -> None:
    # json.loads raises RecursionError (not a ValueError) on deep nesting: validation
    # dies on it each time it is tried, and the batch stays `validating` for 24 hours.
    await fleet.start(WORKERS, config=config(fleet))
    deep = (b'{"custom_id": "deep", "method": "POST", "url": "/v1/chat/completions", '
            b'"body": {"model": "m", "messages": [], "metadata": '
            + b"[" * 50_000 + b"]" * 50_000 + b"}}")
    async with client(fleet.url) as openai:
        created = await create(openai, jsonl(2) + deep + b"\n")
        done = await ended(openai, created.id)
        output = await lines_of(openai, done.output_file_id)
        errors = await lines_of(openai, done.error_file_id)
    assert done.status == "completed", (done.status, done.errors)
    assert sorted(line["custom_id"] for line in output) == ["req-0", "req-1"]
    assert [line["error"]["code"] for line in errors] == ["invalid_json_line"]


async def test_a_deeply_nested_create_body_is_a_400_in_openai_format(fleet: OpsFleet) -> None:
    # The same RecursionError escapes POST /v1/batches' body parsing: aiohttp answers
    # 500 "Internal Server Error" in plain text instead of OpenAI's JSON error.
    await fleet.start(WORKERS, config=config(fleet))
    body = (b'{"endpoint": "/v1/chat/completions", "completion_window": "24h", '
            b'"input_file_id": "file-x", "metadata": ' + b"[" * 25_000 + b"]" * 25_000 + b"}")
    status, content_type, answer = await raw(
        "POST", fleet.url + "/v1/batches", data=body,
        headers={"Content-Type": "application/json"})
    assert status == 400, (status, answer[:200])
    openai_error(status, content_type, answer)


async def test_a_custom_id_is_unique_across_the_file_faulty_lines_included(
        fleet: OpsFleet) -> None:
    # Only lines that will run are checked for a custom_id given twice: a faulty line
    # that reuses a running line's custom_id leaves that custom_id twice in the results,
    # which then cannot be matched to their requests by custom_id.
    await fleet.start(WORKERS, config=config(fleet))
    data = b"\n".join([row("a"), row("a", method="GET"), row("b"), row("b", stream=True)])
    async with client(fleet.url) as openai:
        created = await create(openai, data + b"\n")
        done = await ended(openai, created.id)
        output = await lines_of(openai, done.output_file_id)
        errors = await lines_of(openai, done.error_file_id)
    if done.status == "failed":
        assert done.errors is not None
        assert "duplicate_custom_id" in {error.code for error in done.errors.data}
    else:
        ids = [line["custom_id"] for line in output + errors]
        assert len(ids) == len(set(ids)), f"custom_ids answered twice: {sorted(ids)}"


async def test_a_batch_for_a_model_nobody_serves_ends_with_model_not_found(
        fleet: OpsFleet) -> None:
    # A line starts only into a spare slot of a worker serving its model; a model that no
    # worker serves and regions.yaml does not list has none, ever: the batch sits
    # in_progress until it expires 24 h later, where an interactive request for the
    # model is answered 404 model_not_found at once (and OpenAI writes that 404 in the
    # error file for each line).
    await fleet.start(WORKERS, config=config(fleet))
    data = row("x1", model="no-such-model") + b"\n" + row("x2", model="no-such-model") + b"\n"
    async with client(fleet.url) as openai:
        created = await create(openai, data)
        done = await ended(openai, created.id, timeout_s=20.0)
        errors = await lines_of(openai, done.error_file_id)
    assert done.status in ("completed", "failed"), done.status
    if done.status == "completed":
        assert sorted(line["custom_id"] for line in errors) == ["x1", "x2"]
        assert all(line["response"]["status_code"] == 404 for line in errors), errors


async def test_a_file_fault_names_the_line_of_the_file_blank_lines_counted(
        fleet: OpsFleet) -> None:
    # Blank lines are skipped before lines are numbered: a fault after them is reported
    # on the wrong line (here 2 instead of 3), in `errors` and in the error file.
    await fleet.start(WORKERS, config=config(fleet))
    data = row("a") + b"\n\n" + row("a") + b"\n"
    async with client(fleet.url) as openai:
        created = await create(openai, data)
        done = await ended(openai, created.id)
    assert done.status == "failed" and done.errors is not None
    assert [(e.code, e.line) for e in done.errors.data] == [("duplicate_custom_id", 3)]


# --- what held ------------------------------------------------------------------------------


async def test_odd_lines_each_get_their_error_and_the_good_ones_run(fleet: OpsFleet) -> None:
    await fleet.start(WORKERS, config=config(fleet))
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
    async with client(fleet.url) as openai:
        created = await create(openai, b"".join(rows))
        done = await ended(openai, created.id)
        output = await lines_of(openai, done.output_file_id)
        errors = await lines_of(openai, done.error_file_id)
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
async def test_a_file_without_requests_fails_validation(fleet: OpsFleet, data: bytes) -> None:
    await fleet.start(WORKERS, config=config(fleet))
    async with client(fleet.url) as openai:
        created = await create(openai, data)
        done = await ended(openai, created.id)
    assert done.status == "failed" and done.errors is not None
    assert [e.code for e in done.errors.data] == ["empty_file"]
    assert done.output_file_id is None and done.error_file_id is None


async def test_bad_create_and_list_requests_are_400s_naming_the_param(fleet: OpsFleet) -> None:
    await fleet.start(WORKERS, config=config(fleet))
    for worker in WORKERS:
        await fleet.publish(worker, running=8)
    async with client(fleet.url) as openai:
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
        for limit in ("0", "101", "x", "-1"):
            status, content_type, body = await raw(
                "GET", f"{fleet.url}/v1/batches?limit={limit}")
            assert status == 400, (limit, body)
            assert openai_error(status, content_type, body)["param"] == "limit"
        page = await openai.batches.list(after="batch_" + "0" * 32)
        assert page.data == []
        with pytest.raises(NotFoundError):
            await openai.batches.retrieve("batch_" + "x" * 100)


async def test_a_line_for_another_endpoint_fails_validation(fleet: OpsFleet) -> None:
    await fleet.start(WORKERS, config=config(fleet))
    data = row("a") + b"\n" + row("b", url="/v1/completions") + b"\n" + row("c", model="n")
    async with client(fleet.url) as openai:
        created = await create(openai, data + b"\n")
        done = await ended(openai, created.id)
    assert done.status == "failed" and done.errors is not None
    assert [(e.code, e.line) for e in done.errors.data] == [
        ("invalid_url", 2), ("mismatched_model", 3)]


async def test_another_tenants_file_and_batch_cannot_be_reached(fleet: OpsFleet) -> None:
    await fleet.start(WORKERS, config=config(fleet, keys=True))
    async with client(fleet.url, KEYS["acme"]) as acme, \
            client(fleet.url, KEYS["other"]) as other:
        created = await create(acme, jsonl(3))
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
        status, content_type, body = await raw("GET", fleet.url + "/v1/batches")
        assert status == 401
        openai_error(status, content_type, body)
        # Cancelling twice, and a finished batch: 409, the batch unchanged.
        with pytest.raises(Exception, match=r"409|Cannot cancel"):
            await acme.batches.cancel(created.id)
        assert (await acme.batches.retrieve(created.id)).status == "completed"


async def test_cancelling_twice_and_a_validating_batch(fleet: OpsFleet) -> None:
    await fleet.start(WORKERS, config=config(fleet))
    for worker in WORKERS:
        await fleet.publish(worker, running=8)
    async with client(fleet.url) as openai:
        created = await create(openai, jsonl(3))
        first = await openai.batches.cancel(created.id)
        assert first.status in ("cancelling", "cancelled")
        with pytest.raises(Exception, match=r"409|Cannot cancel"):
            await openai.batches.cancel(created.id)
        done = await ended(openai, created.id)
        errors = await lines_of(openai, done.error_file_id)
    assert done.status == "cancelled" and done.cancelled_at
    ids = sorted(line["custom_id"] for line in errors)
    assert ids in ([], ["req-0", "req-1", "req-2"]), ids


async def test_files_odd_uploads_and_deleted_inputs(fleet: OpsFleet) -> None:
    await fleet.start(WORKERS, config=config(fleet))
    for worker in WORKERS:
        await fleet.publish(worker, running=8)
    async with client(fleet.url) as openai:
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
        created = await create(openai, jsonl(20))
        while (await openai.batches.retrieve(created.id)).status == "validating":  # noqa: ASYNC110
            await asyncio.sleep(0.1)
        await openai.files.delete(created.input_file_id)
        with pytest.raises(NotFoundError):
            await openai.files.content(created.input_file_id)
        for worker in WORKERS:
            await fleet.publish(worker, running=0)
        done = await ended(openai, created.id)
        output = await lines_of(openai, done.output_file_id)
        errors = await lines_of(openai, done.error_file_id)
    assert len(output) + len(errors) == 20
    assert len({line["id"] for line in output + errors}) == 20


async def test_raw_http_errors_are_openai_json(fleet: OpsFleet) -> None:
    await fleet.start(WORKERS, config=config(fleet))
    url = fleet.url
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
        status, content_type, body = await raw(
            method, url + path, data=data, headers={"Content-Type": "application/json"})
        assert status == expected, (method, path, status, body[:200])
        error = openai_error(status, content_type, body)
        assert "127.0.0.1" not in error["message"], error
