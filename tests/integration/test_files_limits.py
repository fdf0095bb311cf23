"""The Files and Batch APIs' bounds on a tenant, through real router apps and a real Valkey:
each call is a request against the key's and tenant's request limits; a tenant keeps at
most `batch.max_files_per_tenant` files; an upload (or a batch's create body) that stops
arriving for `router.client_timeouts.body_s` is a 408 leaving nothing, while one that keeps
sending may take longer than that in all."""

from __future__ import annotations

import asyncio
import hashlib
import json
from typing import Any

import aiohttp
import openai
import pytest

from tests.integration.operators_fleet import OpsFleet, fleet_config
from tests.integration.test_files_api import LINES, client, record_keys, stored_blobs

pytestmark = pytest.mark.integration

KEYS = {"capped": "sk-capped-files-limits-01", "picky": "sk-picky-files-limits-02",
        "free": "sk-free-files-limits-03"}
BOUNDARY = "filesLimitsBoundary"


def limits_config(fleet: OpsFleet, *, batch: dict[str, Any] | None = None,
                  **router: Any) -> dict[str, Any]:
    config = fleet_config(fleet.redis_url, fleet.key_prefix, **router)
    config["batch"] = {"storage": f"file://{fleet.tmp_path / 'files'}", **(batch or {})}
    tenants = {"capped": {"limits": {"requests_per_min": 3}},
               "picky": {"allowed_models": ["only-this-one"], "limits": {"tokens_per_min": 100}},
               "free": {}}
    config["auth"] = {"tenants": tenants,
                      "keys": [{"id": f"{tenant}-key", "tenant": tenant,
                                "sha256": hashlib.sha256(key.encode()).hexdigest()}
                               for tenant, key in KEYS.items()]}
    return config


def part(name: str, value: bytes, filename: str | None = None) -> bytes:
    disposition = f'Content-Disposition: form-data; name="{name}"'
    if filename is not None:
        disposition += f'; filename="{filename}"'
    return f"--{BOUNDARY}\r\n{disposition}\r\n\r\n".encode() + value + b"\r\n"


def form(*parts: bytes) -> bytes:
    return b"".join(parts) + f"--{BOUNDARY}--\r\n".encode()


async def post_slowly(fleet: OpsFleet, path: str, body: bytes, sent: int, *, content_type: str,
                      pause_s: float, pieces: int = 1, wait_s: float = 5.0) -> bytes | None:
    """POST `body` by hand: its first `sent` bytes in `pieces` pieces `pause_s` apart, then
    nothing more (the rest too when `sent` is all of it); the answer's first bytes, or None
    when none came within `wait_s` after."""
    host, port = fleet.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}\r\n"
                     f"Authorization: Bearer {KEYS['free']}\r\nContent-Type: {content_type}\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode())
        step = -(-sent // pieces)
        for start in range(0, sent, step):
            writer.write(body[start:start + step])
            await writer.drain()
            await asyncio.sleep(pause_s)
        try:
            async with asyncio.timeout(wait_s):
                return await reader.read(4096)
        except TimeoutError:
            return None
    finally:
        writer.close()


def error_of(answer: bytes | None) -> tuple[int, dict[str, Any]]:
    assert answer, answer
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"application/json" in head, head
    return int(head.split()[1]), json.loads(body)["error"]


async def test_batch_api_calls_count_against_the_tenants_request_limit(fleet: OpsFleet) -> None:
    await fleet.start({}, config=limits_config(fleet))
    async with client(fleet.url, KEYS["capped"]) as api:
        for _ in range(3):
            await api.batches.list()
        with pytest.raises(openai.RateLimitError) as refused:
            await api.batches.retrieve("batch_unknown")
        assert refused.value.code == "rate_limit_exceeded"
        assert refused.value.response.headers["Retry-After"]
        with pytest.raises(openai.RateLimitError):  # (the Files API shares the budget)
            await api.files.list()
    async with client(fleet.url, KEYS["free"]) as api:  # another tenant: unaffected
        await api.batches.list()


async def test_a_keys_model_list_and_token_limit_do_not_bar_the_files_api(
        fleet: OpsFleet) -> None:
    await fleet.start({}, config=limits_config(fleet))
    async with client(fleet.url, KEYS["picky"]) as api:
        made = await api.files.create(file=("in.jsonl", LINES), purpose="batch")
        page = await api.files.list()
        assert [file.id for file in page.data] == [made.id]
        assert (await api.batches.list()).data == []


async def test_a_tenant_keeps_at_most_max_files_per_tenant(fleet: OpsFleet) -> None:
    await fleet.start({}, config=limits_config(fleet, batch={"max_files_per_tenant": 2}))
    async with client(fleet.url, KEYS["free"]) as api, \
            client(fleet.url, KEYS["picky"]) as other:
        made = [await api.files.create(file=(f"{n}.jsonl", LINES), purpose="batch")
                for n in range(2)]
        blobs = stored_blobs(fleet)
        with pytest.raises(openai.RateLimitError) as refused:
            await api.files.create(file=("3.jsonl", LINES), purpose="batch")
        assert refused.value.code == "file_limit_reached"
        assert "at most 2" in refused.value.message
        assert stored_blobs(fleet) == blobs
        await other.files.create(file=("theirs.jsonl", LINES), purpose="batch")
        await api.files.delete(made[0].id)
        await api.files.create(file=("3.jsonl", LINES), purpose="batch")


@pytest.mark.parametrize("purpose_first", [True, False])
async def test_a_stalled_upload_is_408_and_leaves_nothing(fleet: OpsFleet,
                                                          purpose_first: bool) -> None:
    await fleet.start({}, config=limits_config(fleet, client_timeouts={"body_s": 1.0}))
    parts = [part("purpose", b"batch"), part("file", LINES * 3000, filename="slow.jsonl")]
    body = form(*(parts if purpose_first else reversed(parts)))
    answer = await post_slowly(fleet, "/v1/files", body, 150_000, pause_s=0.1,
                               content_type=f"multipart/form-data; boundary={BOUNDARY}")
    status, error = error_of(answer)
    assert (status, error["code"]) == (408, "upload_timed_out"), error
    await asyncio.sleep(0.3)
    assert stored_blobs(fleet) == []
    assert await record_keys(fleet.redis_url, fleet.key_prefix) == []


async def test_an_upload_that_keeps_sending_may_take_longer_than_body_s(
        fleet: OpsFleet) -> None:
    await fleet.start({}, config=limits_config(fleet, client_timeouts={"body_s": 1.0}))
    body = form(part("purpose", b"batch"), part("file", LINES * 3000, filename="slow.jsonl"))
    answer = await post_slowly(fleet, "/v1/files", body, len(body), pieces=8, pause_s=0.4,
                               content_type=f"multipart/form-data; boundary={BOUNDARY}")
    assert answer is not None and answer.startswith(b"HTTP/1.1 200"), answer
    assert len(stored_blobs(fleet)) == 1


async def test_a_stalled_batch_create_body_is_408(fleet: OpsFleet) -> None:
    await fleet.start({}, config=limits_config(fleet, client_timeouts={"body_s": 1.0}))
    body = json.dumps({"input_file_id": "file-x", "endpoint": "/v1/chat/completions",
                       "completion_window": "24h"}).encode()
    answer = await post_slowly(fleet, "/v1/batches", body, 20, pause_s=0.1,
                               content_type="application/json")
    status, error = error_of(answer)
    assert status == 408, error
    async with aiohttp.ClientSession() as http, http.get(
            f"{fleet.url}/v1/batches", headers={"Authorization": f"Bearer {KEYS['free']}"}
    ) as response:
        assert response.status == 200
