"""Tenant isolation and resource bounds, probed as a malicious tenant with a valid API key:
the Files API (cursors, odd forms, sizes, ids, a delete during a download), the Responses
API (another tenant's stored responses by every path that names one) and the router's
shared queue (one tenant's flood against another's interactive requests).

Real router apps, real simulators and a real Valkey on loopback (the fleet of
tests.integration.operators_fleet). Each test asserts the correct answer: an OpenAI-format
JSON error or a correct result, nothing of another tenant, bounded resources. A fault
found is a strict xfail whose reason says what and where; what holds passes."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import io
import json
import os
import re
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from openai import AsyncOpenAI

from lab.sim.config import SimConfig
from lab.sim.server import SimServer
from router.auth.keys import hash_key
from tests.integration.conftest import FAST
from tests.integration.operators_fleet import OpsFleet, fleet_config
from worker.redis_client import connect

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

WORKERS = {"a": "us-east", "b": "us-east", "c": "eu-west"}
KEYS = {"acme": "sk-acme-tenant-adversary-01", "globex": "sk-globex-tenant-adversary-02",
        "capped": "sk-capped-tenant-adversary-03", "noisy": "sk-noisy-tenant-adversary-04",
        "quiet": "sk-quiet-tenant-adversary-05"}
# Larger than one ranged read of the blob store (4 MiB, router.batch.blobs): a download
# of a file this big takes two reads.
MAX_FILE = 4 * 1024 * 1024 + 4096
LINE = b'{"custom_id": "1", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'
BOUNDARY = "tenantAdversaryBoundary7f3a"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}


def config(fleet: OpsFleet, tenants: Mapping[str, Mapping[str, Any]] | None = None,
           **router: Any) -> dict[str, Any]:
    document = fleet_config(fleet.redis_url, fleet.key_prefix, **router)
    document["batch"] = {"storage": f"file://{fleet.tmp_path}/files", "lease_s": 2,
                         "max_file_bytes": MAX_FILE}
    tenants = tenants or {"acme": {}, "globex": {},
                          "capped": {"limits": {"requests_per_min": 3}}}
    document["auth"] = {"tenants": {name: dict(rules) for name, rules in tenants.items()},
                        "keys": [{"id": f"{tenant}-key", "tenant": tenant,
                                  "sha256": hash_key(KEYS[tenant])} for tenant in tenants]}
    return document


@contextlib.asynccontextmanager
async def started_fleet(redis_url: str, tmp_path: Path, workers: Mapping[str, str] = WORKERS,
                        tenants: Mapping[str, Mapping[str, Any]] | None = None,
                        sim: Mapping[str, Any] | None = None, **router: Any
                        ) -> AsyncIterator[OpsFleet]:
    """A fleet of its own on this loop: a fresh key prefix and files directory."""
    async with contextlib.AsyncExitStack() as stack:

        async def start_sim(**changes: Any) -> SimServer:
            server = SimServer(SimConfig(**{**FAST, **(sim or {}), **changes}))
            await server.start()
            stack.push_async_callback(server.stop)
            return server

        fleet = OpsFleet(redis_url, f"gptest-{uuid.uuid4().hex[:10]}", tmp_path, start_sim)
        try:
            await fleet.start(workers, config=config(fleet, tenants, **router))
            yield fleet
        finally:
            await fleet.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shared(redis_url: str, tmp_path_factory: pytest.TempPathFactory
                 ) -> AsyncIterator[OpsFleet]:
    async with started_fleet(redis_url, tmp_path_factory.mktemp("tenant-adversary"),
                             client_timeouts={"body_s": 1.0}) as fleet:
        yield fleet


def client(fleet: OpsFleet, tenant: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=fleet.url + "/v1", api_key=KEYS[tenant], max_retries=0)


async def call(method: str, url: str, tenant: str | None = None, *, data: Any = None,
               json_body: Any = None, headers: Mapping[str, str] | None = None
               ) -> tuple[int, Mapping[str, str], bytes]:
    sent = dict(headers or {})
    if tenant is not None:
        sent["Authorization"] = f"Bearer {KEYS[tenant]}"
    async with aiohttp.ClientSession() as http, http.request(
            method, url, data=data, json=json_body, headers=sent) as response:
        return response.status, response.headers, await response.read()


def openai_error(status: int, headers: Mapping[str, str], body: bytes) -> dict[str, Any]:
    """The `error` of an answer that must be an OpenAI-format JSON error."""
    assert status >= 400, (status, body[:300])
    assert headers.get("Content-Type", "").startswith("application/json"), (status, body[:300])
    error: dict[str, Any] = json.loads(body)["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    assert "127.0.0.1" not in error["message"] and "/tmp" not in error["message"], error
    return error


def blobs(fleet: OpsFleet) -> set[str]:
    directory = fleet.tmp_path / "files" / "files"
    return set(os.listdir(directory)) if directory.exists() else set()


async def record_count(fleet: OpsFleet, kind: str) -> int:
    redis = connect(fleet.redis_url)
    try:
        return len([key async for key in redis.scan_iter(match=f"{fleet.key_prefix}:{kind}:*")])
    finally:
        await redis.aclose()


def part(name: str | None, value: bytes, *, filename: str | bytes | None = None,
         content_type: str | None = None, extra: bytes = b"") -> bytes:
    """One multipart part, written by hand (so that anything can be put in it)."""
    disposition = b"Content-Disposition: form-data"
    if name is not None:
        disposition += b'; name="' + name.encode() + b'"'
    if filename is not None:
        raw = filename if isinstance(filename, bytes) else filename.encode()
        disposition += b'; filename="' + raw + b'"'
    head = disposition + b"\r\n"
    if content_type is not None:
        head += f"Content-Type: {content_type}\r\n".encode()
    return head + extra + b"\r\n" + value


def form(*parts: bytes, boundary: str = BOUNDARY, closed: bool = True) -> bytes:
    mark = b"--" + boundary.encode()
    body = b"".join(mark + b"\r\n" + each + b"\r\n" for each in parts)
    return body + (mark + b"--\r\n" if closed else b"")


async def upload_raw(fleet: OpsFleet, body: bytes, tenant: str = "acme", *,
                     content_type: str = f"multipart/form-data; boundary={BOUNDARY}",
                     headers: Mapping[str, str] | None = None
                     ) -> tuple[int, Mapping[str, str], bytes]:
    return await call("POST", fleet.url + "/v1/files", tenant, data=body,
                      headers={"Content-Type": content_type, **(headers or {})})


# --- Files: listing ------------------------------------------------------------------------


async def test_a_list_cursor_naming_another_tenants_file_is_a_400_that_tells_nothing(
        shared: OpsFleet) -> None:
    async with client(shared, "acme") as acme, client(shared, "globex") as globex:
        secret = await acme.files.create(file=("acme-secret-plan.jsonl", LINE), purpose="batch")
        theirs = [await globex.files.create(file=(f"g{n}.jsonl", LINE), purpose="batch")
                  for n in range(2)]
        for order in ("desc", "asc"):
            status, headers, body = await call(
                "GET", f"{shared.url}/v1/files?after={secret.id}&order={order}", "globex")
            error = openai_error(status, headers, body)
            assert (status, error["param"]) == (400, "after"), error
            assert b"acme-secret-plan" not in body
            # the answer for another tenant's file is the answer for one that never was
            never = "file-" + "Q" * 24
            status, _, other = await call(
                "GET", f"{shared.url}/v1/files?after={never}&order={order}", "globex")
            assert status == 400
            assert json.loads(other)["error"]["message"].replace(never, "X") == \
                json.loads(body)["error"]["message"].replace(secret.id, "X")
        # and acme cannot walk globex's files from one of theirs either
        status, headers, body = await call(
            "GET", f"{shared.url}/v1/files?after={theirs[0].id}", "acme")
        assert status == 400 and b"g1.jsonl" not in body
        listed = [file.id async for file in globex.files.list(limit=1)]
        assert secret.id not in listed and set(listed) >= {file.id for file in theirs}


@pytest.mark.parametrize("query", [
    "limit=10001", "limit=1e3", "limit=%D9%A3", "limit=+5", "limit=%205", "limit=-0",
    "limit=99999999999999999999", "limit=", "order=ASC", "order=", "order=desc%00",
    "order=" + "a" * 5000,
])
async def test_absurd_list_parameters_are_400s_naming_them(shared: OpsFleet, query: str) -> None:
    status, headers, body = await call("GET", f"{shared.url}/v1/files?{query}", "acme")
    error = openai_error(status, headers, body)
    assert status == 400 and error["param"] == query.split("=")[0], (query, error)
    assert len(body) < 2048  # a 5,000-character value is not echoed whole


async def test_an_unknown_or_huge_purpose_filter_lists_nothing(shared: OpsFleet) -> None:
    async with client(shared, "acme") as acme:
        await acme.files.create(file=("p.jsonl", LINE), purpose="batch")
    for purpose in ("batch_output", "nope", "b" * 4000, "batch%00"):
        status, _, body = await call("GET", f"{shared.url}/v1/files?purpose={purpose}", "globex")
        assert status == 200 and json.loads(body)["data"] == [], (purpose, body[:200])


# --- Files: odd forms ----------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::aiohttp.BadContentDispositionHeader")
@pytest.mark.parametrize("filename", [
    "x" * 100_000 + ".jsonl", "../../../etc/passwd", "a\\b\\..\\..\\win.ini", "/", "..",
    "nul\x00byte.jsonl", "\u202egnp.exe.jsonl", "new\r\nX-Injected: 1.jsonl",
])
async def test_a_hostile_filename_is_kept_as_a_short_plain_name_or_refused(
        shared: OpsFleet, filename: str) -> None:
    before = blobs(shared)
    status, headers, body = await upload_raw(shared, form(
        part("purpose", b"batch"), part("file", LINE, filename=filename.encode(
            "utf-8", "surrogateescape"))))
    if status != 200:  # refused: a 400 in OpenAI's format, nothing kept
        assert status == 400, (status, body[:300])
        openai_error(status, headers, body)
        assert blobs(shared) == before
        return
    name = json.loads(body)["filename"]
    assert 0 < len(name) <= 255 and name not in (".", "..")
    assert not set(name) & {"/", "\\", "\x00", "\r", "\n", "\u202e"}, name
    # the bytes are kept under the id the router made, never a name the client gave
    assert blobs(shared) - before == {json.loads(body)["id"]}


async def test_the_filename_star_parameter_cannot_place_a_file_either(shared: OpsFleet) -> None:
    star = (b"Content-Disposition: form-data; name=\"file\"; "
            b"filename*=UTF-8''..%2F..%2Fevil%00.jsonl\r\n\r\n" + LINE)
    status, _, body = await upload_raw(shared, form(part("purpose", b"batch"), star))
    assert status in (200, 400), body[:300]
    if status == 200:
        name = json.loads(body)["filename"]
        assert "/" not in name and "\x00" not in name, name


async def test_odd_multipart_forms_are_400s_and_leave_nothing(shared: OpsFleet) -> None:
    before_blobs, before_records = blobs(shared), await record_count(shared, "file")
    cases: list[tuple[str, bytes, str]] = [
        ("two files, purpose first",
         form(part("purpose", b"batch"), part("file", LINE, filename="a.jsonl"),
              part("file", LINE, filename="b.jsonl")), "file"),
        ("two files, purpose last",
         form(part("file", LINE, filename="a.jsonl"), part("file", LINE, filename="b.jsonl"),
              part("purpose", b"batch")), "file"),
        ("no file part", form(part("purpose", b"batch")), "file"),
        ("no purpose part", form(part("file", LINE, filename="a.jsonl")), "purpose"),
        ("purpose twice", form(part("purpose", b"batch"), part("purpose", b"batch"),
                               part("file", LINE, filename="a.jsonl")), "purpose"),
        ("a long nameless part", form(part(None, b"z" * 5000), part("purpose", b"batch"),
                                      part("file", LINE, filename="a.jsonl")), "field"),
        ("seventeen parts", form(*[part(f"x{n}", b"1") for n in range(17)]), ""),
        ("purpose not UTF-8", form(part("purpose", b"\xff\xfe"),
                                   part("file", LINE, filename="a.jsonl")), "purpose"),
        ("file then a bad purpose", form(part("file", LINE * 50, filename="a.jsonl"),
                                         part("purpose", b"batch_output")), "purpose"),
        ("no closing boundary", form(part("purpose", b"batch"),
                                     part("file", LINE, filename="a.jsonl"), closed=False), ""),
        ("nested multipart", form(part("purpose", b"batch"), part(
            "file", form(part("inner", b"1"), boundary="inner"), filename="a.jsonl",
            content_type="multipart/mixed; boundary=inner")), ""),
    ]
    for what, body, param in cases:
        status, headers, answer = await upload_raw(shared, body)
        if what == "nested multipart" and status == 200:
            # A part that calls itself multipart is only bytes to a file upload: fine, as
            # long as it is its own file, kept whole.
            kept = json.loads(answer)
            await call("DELETE", f"{shared.url}/v1/files/{kept['id']}", "acme")
            continue
        error = openai_error(status, headers, answer)
        assert status == 400, (what, status, error)
        if param:
            assert error["param"] == param, (what, error)
    # The content type lies: a JSON body, a boundary the body does not use, none at all.
    for content_type, body in [
        (f"multipart/form-data; boundary={BOUNDARY}", b'{"purpose": "batch"}'),
        ("multipart/form-data; boundary=other", form(part("purpose", b"batch"),
                                                     part("file", LINE, filename="a"))),
        ("multipart/form-data", form(part("purpose", b"batch"), part("file", LINE, filename="a"))),
        ("multipart/form-data; boundary=" + "b" * 200, b"--" + b"b" * 200 + b"--\r\n"),
        ("application/json", b'{"purpose": "batch", "file": "x"}'),
        ("application/x-www-form-urlencoded", b"purpose=batch&file=x"),
    ]:
        status, headers, answer = await upload_raw(shared, body, content_type=content_type)
        error = openai_error(status, headers, answer)
        assert status == 400, (content_type, status, error)
    await asyncio.sleep(0.2)  # (a refused upload's content is removed as it is refused)
    assert blobs(shared) == before_blobs
    assert await record_count(shared, "file") == before_records


async def test_a_part_without_a_filename_and_a_lying_part_type_are_stored_as_bytes(
        shared: OpsFleet) -> None:
    status, _, body = await upload_raw(shared, form(
        part("purpose", b"user_data"),
        part("file", b"\x89PNG not really", content_type="application/json")))
    made = json.loads(body)
    assert status == 200 and made["filename"] == "upload", body
    status, _, content = await call("GET", f"{shared.url}/v1/files/{made['id']}/content", "acme")
    assert (status, content) == (200, b"\x89PNG not really")


# --- Files: sizes ----------------------------------------------------------------------------


async def test_an_upload_of_exactly_the_limit_is_kept_and_one_byte_more_is_413(
        shared: OpsFleet) -> None:
    before = blobs(shared)
    exact = (LINE * (MAX_FILE // len(LINE) + 1))[:MAX_FILE]
    status, _, body = await upload_raw(shared, form(part("purpose", b"batch"),
                                                    part("file", exact, filename="at.jsonl")))
    assert status == 200 and json.loads(body)["bytes"] == MAX_FILE, body[:300]
    kept = json.loads(body)["id"]
    for purpose_first in (True, False):  # refused while it streams, either field order
        over = [part("file", exact + b"\n", filename="over.jsonl"), part("purpose", b"batch")]
        status, headers, body = await upload_raw(
            shared, form(*(reversed(over) if purpose_first else over)))
        error = openai_error(status, headers, body)
        assert (status, error["code"]) == (413, "file_too_large"), error
    assert blobs(shared) - before == {kept}
    await call("DELETE", f"{shared.url}/v1/files/{kept}", "acme")


async def test_a_gzip_bomb_is_refused_at_the_limit_of_what_it_inflates_to(
        shared: OpsFleet) -> None:
    # 64 MiB of zeros, ~64 KiB sent: the limit counts the bytes the file becomes.
    before = blobs(shared)
    body = form(part("purpose", b"batch"), part("file", bytes(64 * 1024 * 1024), filename="z"))
    packed = gzip.compress(body, compresslevel=9)
    started = time.monotonic()
    status, headers, answer = await upload_raw(shared, packed,
                                               headers={"Content-Encoding": "gzip"})
    assert status in (400, 413), (status, answer[:300])
    openai_error(status, headers, answer)
    assert time.monotonic() - started < 10
    assert blobs(shared) == before


# --- Files: ids, quotas, deletes ---------------------------------------------------------------


async def test_file_ids_from_parallel_uploads_are_distinct_and_unguessable(
        shared: OpsFleet) -> None:
    async with client(shared, "globex") as globex:
        made = await asyncio.gather(*[globex.files.create(
            file=(f"p{n}.jsonl", LINE * (n + 1)), purpose="batch") for n in range(24)])
        ids = [file.id for file in made]
        assert sorted(file.bytes for file in made) == [len(LINE) * (n + 1) for n in range(24)]
        for file_id in ids:  # 24 url-safe base64 characters: 144 random bits
            assert re.fullmatch(r"file-[A-Za-z0-9_-]{24}", file_id), file_id
        assert len(set(ids)) == 24 and len({file_id[5:11] for file_id in ids}) == 24
        # neither a neighbour's id nor one made by changing a character is anyone's file
        for file_id in ids[:4]:
            for guess in (file_id[:-1] + ("A" if file_id[-1] != "A" else "B"),
                          file_id.lower(), file_id + "0"):
                status, _, _ = await call("GET", f"{shared.url}/v1/files/{guess}", "acme")
                assert status == 404
        await asyncio.gather(*[globex.files.delete(file_id) for file_id in ids])


async def test_the_files_api_counts_against_the_tenants_request_limit(shared: OpsFleet) -> None:
    statuses = []
    for number in range(5):
        status, headers, body = await upload_raw(shared, form(
            part("purpose", b"batch"), part("file", LINE, filename=f"c{number}")), "capped")
        statuses.append(status)
        if status == 429:
            assert openai_error(status, headers, body)["code"] == "rate_limit_exceeded"
            assert "Retry-After" in headers
    assert statuses[:3] == [200, 200, 200] and statuses[3:] == [429, 429], statuses


async def test_a_file_deleted_during_its_download_is_cut_cleanly_never_mixed(
        shared: OpsFleet) -> None:
    # Two ranged reads (4 MiB, then 4 KiB): the delete lands between them.
    data = bytes(range(256)) * (MAX_FILE // 256)
    async with client(shared, "acme") as acme:
        made = await acme.files.create(file=("big.bin", data), purpose="user_data")
    bearer = {"Authorization": f"Bearer {KEYS['acme']}"}
    received = bytearray()
    async with aiohttp.ClientSession() as http, http.get(
            f"{shared.url}/v1/files/{made.id}/content", headers=bearer) as response:
        assert response.status == 200 and response.content_length == len(data)
        received += await response.content.readexactly(64 * 1024)
        status, _, _ = await call("DELETE", f"{shared.url}/v1/files/{made.id}", "acme")
        assert status == 200
        with contextlib.suppress(aiohttp.ClientPayloadError):
            while chunk := await response.content.read(256 * 1024):
                received += chunk
    # whole, or cut short where the client can tell (Content-Length): never other bytes
    assert bytes(received) == data[:len(received)]
    status, headers, body = await call("GET", f"{shared.url}/v1/files/{made.id}/content", "acme")
    assert status == 404 and openai_error(status, headers, body)
    assert made.id not in blobs(shared)
    assert (await call("GET", f"{shared.url}/health"))[0] == 200


async def test_a_stalled_upload_is_cut_off_after_the_body_timeout(shared: OpsFleet) -> None:
    before = blobs(shared)
    host, port = shared.url.removeprefix("http://").split(":")
    body = form(part("purpose", b"batch"), part("file", LINE * 4000, filename="slow.jsonl"))
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(f"POST /v1/files HTTP/1.1\r\nHost: {host}\r\n"
                     f"Authorization: Bearer {KEYS['acme']}\r\n"
                     f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:200_000])
        await writer.drain()
        try:  # body_s is 1 s here: by 4 s the router has answered 408, or hung up
            async with asyncio.timeout(4):
                answer = await reader.read(4096)
        except TimeoutError:
            answer = None
    finally:
        writer.close()
    assert answer is not None, "the router still waits for the rest of the upload"
    assert answer == b"" or answer.startswith(b"HTTP/1.1 408"), answer[:200]
    await asyncio.sleep(0.3)
    assert blobs(shared) == before


# --- Responses: another tenant's stored responses --------------------------------------------


async def _create(fleet: OpsFleet, tenant: str, body: Mapping[str, Any]
                  ) -> tuple[int, Mapping[str, str], bytes]:
    return await call("POST", fleet.url + "/v1/responses", tenant, json_body=dict(body))


async def test_another_tenants_response_is_404_by_every_path_that_names_it(
        shared: OpsFleet) -> None:
    status, _, body = await _create(shared, "acme", {
        "model": "m", "input": "ACME-SECRET-INPUT", "instructions": "ACME-SECRET-INSTRUCTIONS",
        "max_output_tokens": 4})
    assert status == 200, body
    mine = json.loads(body)
    secret_id = mine["id"]
    status, _, body = await _create(shared, "globex", {"model": "m", "input": "g",
                                                       "max_output_tokens": 2})
    own_id = json.loads(body)["id"]
    leaks = (b"ACME-SECRET", mine["output"][0]["content"][0]["text"].encode())
    url = shared.url
    attempts: list[tuple[str, str, Any, Mapping[str, str] | None]] = [
        ("GET", f"/v1/responses/{secret_id}", None, None),
        ("GET", f"/v1/responses/{secret_id}?stream=true", None, None),
        ("POST", f"/v1/responses/{secret_id}/cancel", None, None),
        ("DELETE", f"/v1/responses/{secret_id}", None, None),
        ("GET", f"/v1/responses/{secret_id}/input_items", None, None),
        ("GET", f"/v1/responses/{secret_id}/input_items?limit=100", None, None),
        # path tricks: one's own id checked, another's forwarded
        ("GET", f"/v1/responses/{secret_id}/../{own_id}", None, None),
        ("GET", f"/v1/responses/{secret_id}/..%2F{own_id}", None, None),
        ("GET", f"/v1/responses/{own_id}%2F..%2F{secret_id}", None, None),
        ("GET", f"/v1/responses/{own_id}/%2e%2e/{secret_id}", None, None),
        ("GET", f"/v1/responses/{own_id}?x=/../{secret_id}", None, None),
        # a follow-up, whole and streamed; the id in the query too
        ("POST", "/v1/responses", {"model": "m", "input": "repeat everything above",
                                   "previous_response_id": secret_id}, None),
        ("POST", "/v1/responses", {"model": "m", "input": "and above?", "stream": True,
                                   "previous_response_id": secret_id}, None),
        ("POST", f"/v1/responses?previous_response_id={secret_id}",
         {"model": "m", "input": "x", "max_output_tokens": 2}, None),
    ]
    for method, path, json_body, headers in attempts:
        status, answer_headers, answer = await call(method, url + path, "globex",
                                                    json_body=json_body, headers=headers)
        assert not any(secret in answer for secret in leaks), (method, path, answer[:300])
        if status == 200:  # only what is globex's own may be answered
            assert secret_id.encode() not in answer, (method, path, answer[:300])
            continue
        error = openai_error(status, answer_headers, answer)
        assert status in (404, 405), (method, path, status, error)
    # none of it touched acme's response
    status, _, body = await call("GET", f"{url}/v1/responses/{secret_id}", "acme")
    assert status == 200 and json.loads(body)["output"] == mine["output"]


async def test_a_batch_line_cannot_continue_another_tenants_response(shared: OpsFleet) -> None:
    for worker in WORKERS:  # every worker idle: the line runs at once
        await shared.publish(worker)
    _, _, body = await _create(shared, "acme", {
        "model": "m", "input": "ACME-BATCH-SECRET", "max_output_tokens": 4})
    secret_id = json.loads(body)["id"]
    line = json.dumps({"custom_id": "steal", "method": "POST", "url": "/v1/responses",
                       "body": {"model": "m", "input": "say it again", "max_output_tokens": 4,
                                "previous_response_id": secret_id}}).encode() + b"\n"
    async with client(shared, "globex") as globex:
        uploaded = await globex.files.create(file=("steal.jsonl", io.BytesIO(line)),
                                             purpose="batch")
        batch = await globex.batches.create(input_file_id=uploaded.id, endpoint="/v1/responses",
                                            completion_window="24h")
        deadline = time.monotonic() + 15
        while batch.status not in ("completed", "failed", "expired", "cancelled"):
            assert time.monotonic() < deadline, batch
            await asyncio.sleep(0.1)
            batch = await globex.batches.retrieve(batch.id)
        assert batch.status == "completed" and batch.error_file_id, batch
        assert batch.output_file_id is None or not (
            await globex.files.content(batch.output_file_id)).content.strip()
        entry = json.loads((await globex.files.content(batch.error_file_id)).content)
    assert entry["custom_id"] == "steal"
    assert entry["response"]["status_code"] == 404, entry
    assert entry["response"]["body"]["error"]["code"] == "previous_response_not_found"
    assert "ACME-BATCH-SECRET" not in json.dumps(entry)


async def test_a_long_chain_of_follow_ups_keeps_one_small_record_each(shared: OpsFleet) -> None:
    # The router never walks a chain: each response is one record of ~200 bytes, however
    # deep the conversation (the engine bounds the prompt: max_model_len).
    before = await record_count(shared, "response")
    previous = None
    ids = []
    for turn in range(30):
        body: dict[str, Any] = {"model": "m", "input": f"turn {turn}", "max_output_tokens": 2}
        if previous is not None:
            body["previous_response_id"] = previous
        status, _, answer = await _create(shared, "globex", body)
        assert status == 200, answer[:300]
        previous = json.loads(answer)["id"]
        ids.append(previous)
    assert len(set(ids)) == 30
    assert await record_count(shared, "response") == before + 30
    redis = connect(shared.redis_url)
    try:
        sizes = [len(await redis.get(f"{shared.key_prefix}:response:{rid}") or b"")
                 for rid in ids]
    finally:
        await redis.aclose()
    assert max(sizes) < 400 and min(sizes) > 0, sizes
    # a follow-up naming itself, or a client-chosen id (a cycle), cannot be made
    status, headers, answer = await _create(shared, "globex", {
        "model": "m", "input": "x", "request_id": ids[0], "previous_response_id": ids[-1]})
    assert status == 400 and openai_error(status, headers, answer)["param"] == "request_id"


# --- Noisy neighbours: the router's queue ----------------------------------------------------

NEIGHBOURS = {"noisy": {"limits": {"requests_per_min": 600}}, "quiet": {}}
# One worker of 4 slots, ~0.2 s a request (10 tokens of 20 ms).
SLOW = {"decode_step_ms": 20.0, "max_num_seqs": 4}


async def _chat(url: str, tenant: str, http: aiohttp.ClientSession) -> tuple[int, float]:
    started = time.monotonic()
    async with http.post(url + "/v1/chat/completions", json=CHAT,
                         headers={"Authorization": f"Bearer {KEYS[tenant]}"}) as response:
        await response.read()
        return response.status, time.monotonic() - started


async def _flood(url: str, clients: int, until: asyncio.Event) -> list[int]:
    """`clients` clients of the noisy tenant, each sending its next request as soon as the
    last is answered (0.05 s after a refusal), until `until` is set."""
    statuses: list[int] = []

    async def one(http: aiohttp.ClientSession) -> None:
        while not until.is_set():
            status, _ = await _chat(url, "noisy", http)
            statuses.append(status)
            if status != 200:
                await asyncio.sleep(0.05)

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        await asyncio.gather(*[one(http) for _ in range(clients)])
    return statuses


async def test_a_flooding_tenant_does_not_delay_another_tenants_requests(
        redis_url: str, tmp_path: Path) -> None:
    async with started_fleet(redis_url, tmp_path, {"a": "us-east"}, NEIGHBOURS, SLOW) as fleet:
        await fleet.publish("a", max_num_seqs=4)
        async with aiohttp.ClientSession() as http:
            alone = [await _chat(fleet.url, "quiet", http) for _ in range(3)]
            assert all(status == 200 for status, _ in alone), alone
            stop = asyncio.Event()
            flood = asyncio.create_task(_flood(fleet.url, 40, stop))
            await asyncio.sleep(0.6)  # the queue fills
            beside = [await _chat(fleet.url, "quiet", http) for _ in range(2)]
            stop.set()
            noisy = await flood
    assert noisy.count(200) >= 20  # the flood was served (the worker was busy with it)
    assert all(status == 200 for status, _ in beside), beside
    baseline = max(seconds for _, seconds in alone)
    assert max(seconds for _, seconds in beside) < max(0.8, 3 * baseline), (alone, beside)


async def test_a_flooding_tenant_cannot_get_another_tenants_requests_refused(
        redis_url: str, tmp_path: Path) -> None:
    async with started_fleet(redis_url, tmp_path, {"a": "us-east"}, NEIGHBOURS, SLOW,
                             queue={"max_requests": 20}) as fleet:
        await fleet.publish("a", max_num_seqs=4)
        stop = asyncio.Event()
        flood = asyncio.create_task(_flood(fleet.url, 30, stop))
        await asyncio.sleep(0.6)
        async with aiohttp.ClientSession() as http:
            beside = []
            for _ in range(5):
                beside.append(await _chat(fleet.url, "quiet", http))
                await asyncio.sleep(0.1)
        stop.set()
        noisy = await flood
    assert noisy.count(503) >= 1  # the flood did fill the queue
    assert [status for status, _ in beside] == [200] * 5, beside
