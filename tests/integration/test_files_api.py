"""OpenAI's Files API through real router apps: the unchanged `openai` client against
routers sharing a real Valkey and a storage directory (or a real S3-protocol server, moto's,
on loopback), in front of a real simulator where inference is needed.

Uploads stream to storage and stop at the configured limit leaving nothing behind; each
tenant sees only its own files; what one replica stored another serves; Redis or storage
down is a 503 in OpenAI's format."""

from __future__ import annotations

import asyncio
import hashlib
import os
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI

from lab.devstack.valkey import EmbeddedValkey, free_port
from router.batch.blobs import BlobNotFound, BlobStoreError, open_blob_store
from tests.integration.conftest import StartSim
from tests.integration.operators_fleet import OpsFleet, fleet_config, wait_for
from worker.redis_client import connect

pytestmark = pytest.mark.integration

TENANT_KEYS = {"acme": "sk-acme-files-0123456789", "globex": "sk-globex-files-0123456789"}
LINES = b'{"custom_id": "1", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'


def files_config(fleet: OpsFleet, *, storage: str | None = None, max_file_bytes: int | None = None,
                 keys: bool = False) -> dict[str, Any]:
    config = fleet_config(fleet.redis_url, fleet.key_prefix)
    config["batch"] = {"storage": storage or f"file://{fleet.tmp_path / 'files'}"}
    if max_file_bytes is not None:
        config["batch"]["max_file_bytes"] = max_file_bytes
    if keys:
        config["auth"] = {"tenants": {tenant: {} for tenant in TENANT_KEYS},
                          "keys": [{"id": f"{tenant}-key", "tenant": tenant,
                                    "sha256": hashlib.sha256(key.encode()).hexdigest()}
                                   for tenant, key in TENANT_KEYS.items()]}
    return config


def client(url: str, key: str = "unused") -> AsyncOpenAI:
    return AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def stored_blobs(fleet: OpsFleet) -> list[str]:
    directory = fleet.tmp_path / "files" / "files"
    return sorted(os.listdir(directory)) if directory.exists() else []


async def record_keys(redis_url: str, key_prefix: str) -> list[bytes]:
    redis = connect(redis_url)
    try:
        return [key async for key in redis.scan_iter(match=f"{key_prefix}:file:*")]
    finally:
        await redis.aclose()


async def post_form(url: str, fields: list[tuple[str, bytes | str, str | None]],
                    key: str | None = None) -> tuple[int, dict[str, Any]]:
    """POST /v1/files with the form's fields in this order: (name, value, filename)."""
    form = aiohttp.FormData(default_to_multipart=True)
    for name, value, filename in fields:
        form.add_field(name, value, filename=filename)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as session, session.post(
            url + "/v1/files", data=form, headers=headers) as response:
        return response.status, await response.json(content_type=None)


async def test_upload_retrieve_list_download_and_delete(fleet: OpsFleet) -> None:
    await fleet.start({}, config=files_config(fleet))
    async with client(fleet.url) as api:
        made = [await api.files.create(file=(f"in-{n}.jsonl", LINES * (n + 1)), purpose="batch")
                for n in range(4)]
        other = await api.files.create(file=("notes.txt", b"hello"), purpose="user_data")
        first = made[0]
        assert (first.object, first.purpose, first.status, first.bytes, first.filename) == (
            "file", "batch", "processed", len(LINES), "in-0.jsonl")
        assert first.id.startswith("file-") and first.expires_at is None
        assert await api.files.retrieve(first.id) == first
        assert (await api.files.content(made[2].id)).content == LINES * 3

        ids = [file.id for file in made]
        everything = await api.files.list()
        assert [file.id for file in everything.data] == [other.id, *reversed(ids)]  # newest first
        page = await api.files.list(purpose="batch", limit=3, order="asc")
        assert [file.id for file in page.data] == ids[:3] and page.has_more
        rest = await api.files.list(purpose="batch", limit=3, order="asc", after=ids[2])
        assert [file.id for file in rest.data] == ids[3:] and not rest.has_more
        walked = [file.id async for file in api.files.list(purpose="batch", limit=1)]
        assert walked == list(reversed(ids))  # the client's own pagination, by `after`

        deleted = await api.files.delete(first.id)
        assert (deleted.id, deleted.deleted, deleted.object) == (first.id, True, "file")
        with pytest.raises(openai.NotFoundError, match=f"No such File object: {first.id}"):
            await api.files.retrieve(first.id)
        with pytest.raises(openai.NotFoundError):
            await api.files.delete(first.id)
    assert first.id not in stored_blobs(fleet) and len(stored_blobs(fleet)) == 4


async def test_an_upload_over_the_limit_is_413_and_leaves_nothing(fleet: OpsFleet) -> None:
    await fleet.start({}, config=files_config(fleet, max_file_bytes=4096))
    async with client(fleet.url) as api:
        for size in (4097, 40_000, 400_000):  # (the largest is refused by its length alone)
            with pytest.raises(openai.APIStatusError) as refused:
                await api.files.create(file=("big.jsonl", b"x" * size), purpose="batch")
            assert refused.value.status_code == 413
            assert "at most 4 KiB (4096 bytes)" in refused.value.message
        assert (await api.files.create(file=("fits.jsonl", b"x" * 4096), purpose="batch")
                ).bytes == 4096

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: only streaming stops it
        for _ in range(100):
            yield b"y" * 1024

    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", chunks(), filename="streamed.jsonl")
    async with aiohttp.ClientSession() as session, session.post(
            fleet.url + "/v1/files", data=form) as response:
        assert "Content-Length" not in response.request_info.headers
        assert response.status == 413
        assert (await response.json())["error"]["code"] == "file_too_large"
    assert len(await record_keys(fleet.redis_url, fleet.key_prefix)) == 1  # `fits` only
    assert len(stored_blobs(fleet)) == 1


async def test_a_bad_form_is_400_naming_the_field(fleet: OpsFleet) -> None:
    await fleet.start({}, config=files_config(fleet))
    url = fleet.url
    status, answer = await post_form(url, [("file", LINES, "a.jsonl")])
    assert (status, answer["error"]["param"]) == (400, "purpose")
    status, answer = await post_form(url, [("purpose", "batch", None)])
    assert (status, answer["error"]["param"]) == (400, "file")
    for purpose in ("batch_output", "nonsense"):
        status, answer = await post_form(url, [("purpose", purpose, None),
                                               ("file", LINES, "a.jsonl")])
        assert (status, answer["error"]["param"]) == (400, "purpose"), answer
        assert answer["error"]["type"] == "invalid_request_error"
    # the file first: stored while it arrives, then dropped when the purpose is bad
    status, answer = await post_form(url, [("file", LINES, "a.jsonl"),
                                           ("purpose", "nope", None)])
    assert (status, answer["error"]["param"]) == (400, "purpose")
    assert stored_blobs(fleet) == []
    assert await record_keys(fleet.redis_url, fleet.key_prefix) == []
    status, answer = await post_form(url, [("file", LINES, "a.jsonl"),
                                           ("purpose", "batch", None)])
    assert (status, answer["filename"], answer["bytes"]) == (200, "a.jsonl", len(LINES))
    async with aiohttp.ClientSession() as session, session.post(
            url + "/v1/files", json={"purpose": "batch"}) as response:
        assert response.status == 400
    async with client(url) as api:
        with pytest.raises(openai.BadRequestError, match="limit"):
            await api.files.list(limit=0)
        kept = await api.files.create(file=("../../etc/b.jsonl", LINES), purpose="batch")
        assert kept.filename == "b.jsonl"


async def test_a_client_gone_mid_upload_leaves_nothing(fleet: OpsFleet) -> None:
    await fleet.start({}, config=files_config(fleet))
    port = int(fleet.url.rsplit(":", 1)[1])
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    boundary = "b0undary"
    form_head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\n"
                 f"batch\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
                 f"filename=\"big.jsonl\"\r\n\r\n").encode()
    writer.write(f"POST /v1/files HTTP/1.1\r\nHost: x\r\nContent-Length: {50 << 20}\r\n"
                 f"Content-Type: multipart/form-data; boundary={boundary}\r\n\r\n".encode()
                 + form_head + b"x" * (12 << 20))  # two parts of the upload, then gone
    await writer.drain()
    await wait_for(lambda: any(Path(root, name).stat().st_size
                               for root, _, names in os.walk(fleet.tmp_path / "files")
                               for name in names), timeout_s=5)
    writer.close()
    await wait_for(lambda: not any(names for _, _, names in os.walk(fleet.tmp_path / "files")),
                   timeout_s=5)
    assert await record_keys(fleet.redis_url, fleet.key_prefix) == []


async def test_a_tenant_sees_only_its_own_files(fleet: OpsFleet) -> None:
    await fleet.start({}, config=files_config(fleet, keys=True))
    async with client(fleet.url, TENANT_KEYS["acme"]) as acme, \
            client(fleet.url, TENANT_KEYS["globex"]) as globex, \
            client(fleet.url, "sk-nobody") as nobody:
        mine = await acme.files.create(file=("mine.jsonl", LINES), purpose="batch")
        theirs = await globex.files.create(file=("theirs.jsonl", LINES), purpose="batch")
        for call in (globex.files.retrieve, globex.files.content, globex.files.delete):
            with pytest.raises(openai.NotFoundError, match=f"No such File object: {mine.id}"):
                await call(mine.id)
        assert [file.id async for file in globex.files.list()] == [theirs.id]
        assert [file.id async for file in acme.files.list()] == [mine.id]
        with pytest.raises(openai.AuthenticationError):
            await nobody.files.retrieve(mine.id)
        assert (await acme.files.content(mine.id)).content == LINES  # not deleted


async def test_the_files_api_turned_off_by_a_reload_answers_404(fleet: OpsFleet) -> None:
    config = files_config(fleet)
    await fleet.start({}, config=config)
    async with client(fleet.url) as api:
        made = await api.files.create(file=("x.jsonl", LINES), purpose="batch")
        config["batch"]["enabled"] = False
        fleet.write_config(config)

        async def turned_off() -> bool:
            try:
                await api.files.retrieve(made.id)
            except openai.NotFoundError as exc:
                return "not enabled on this router" in exc.message
            return False

        await wait_for(turned_off, timeout_s=5)
        with pytest.raises(openai.NotFoundError, match="not enabled"):
            await api.files.create(file=("y.jsonl", LINES), purpose="batch")


async def test_what_one_replica_stored_another_serves(fleet: OpsFleet) -> None:
    await fleet.start({}, replicas=2, config=files_config(fleet))
    first, second = fleet.urls
    async with client(first) as one, client(second) as other:
        made = await one.files.create(file=("shared.jsonl", LINES * 50), purpose="batch")
        assert (await other.files.content(made.id)).content == LINES * 50
        assert (await other.files.delete(made.id)).deleted
        with pytest.raises(openai.NotFoundError):
            await one.files.content(made.id)


async def test_redis_down_is_a_503_and_an_upload_leaves_nothing(
        tmp_path: Path, key_prefix: str, start_sim: StartSim) -> None:
    server = EmbeddedValkey.start()
    fleet = OpsFleet(server.url, key_prefix, tmp_path, start_sim)
    try:
        await fleet.start({}, config=files_config(fleet))
        async with client(fleet.url) as api:
            made = await api.files.create(file=("x.jsonl", LINES), purpose="batch")
            server.stop()
            for call in (api.files.retrieve, api.files.content, api.files.delete):
                with pytest.raises(openai.InternalServerError) as unavailable:
                    await call(made.id)
                assert unavailable.value.status_code == 503
                assert unavailable.value.response.headers["Retry-After"] == "1"
                assert unavailable.value.body["code"] == "files_unavailable"  # type: ignore[index]
            with pytest.raises(openai.InternalServerError):
                await api.files.create(file=("y.jsonl", LINES), purpose="batch")
        assert stored_blobs(fleet) == [made.id]  # the refused upload's content is gone
    finally:
        await fleet.close()
        server.stop()


async def test_a_20_mb_upload_through_the_routers_front(fleet: OpsFleet) -> None:
    await fleet.start({"a": "us-east"}, config=files_config(fleet))
    content = os.urandom(20 * 1024 * 1024)
    async with client(fleet.url) as api:
        # (on one keep-alive connection: the front serves the chat, aiohttp the rest)
        answer = await api.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert answer.choices
        made = await api.files.create(file=("big.bin", content), purpose="user_data")
        assert made.bytes == len(content)
        assert (await api.files.content(made.id)).content == content


# -- S3, against moto's S3 server on loopback --
@dataclass
class S3Bucket:
    """A bucket on moto's server, and a boto3 client to look into it with."""

    name: str
    client: Any

    def keys(self) -> list[str]:
        listing = self.client.list_objects_v2(Bucket=self.name)
        return [item["Key"] for item in listing.get("Contents", [])]

    def unfinished_uploads(self) -> list[Any]:
        return list(self.client.list_multipart_uploads(Bucket=self.name).get("Uploads", []))


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Bucket]:
    """An S3 server (moto's) on loopback with a new bucket; AWS_* variables point at it."""
    import boto3  # type: ignore[import-untyped]
    from moto.server import ThreadedMotoServer

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    for name, value in {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
                        "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
                        "AWS_ALLOW_HTTP": "true"}.items():
        monkeypatch.setenv(name, value)
    try:
        bucket = S3Bucket(f"globalpool-{uuid.uuid4().hex[:12]}",
                          boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1"))
        bucket.client.create_bucket(Bucket=bucket.name)
        yield bucket
    finally:
        # (moto keeps its buckets in this process's memory, past the server's stop)
        urllib.request.urlopen(urllib.request.Request(endpoint + "/moto-api/reset",
                                                      method="POST"), timeout=5).close()
        server.stop()


async def test_the_s3_blob_store_streams_reads_and_deletes(s3: S3Bucket) -> None:
    blobs = open_blob_store(f"s3://{s3.name}/some/prefix")
    data = os.urandom(12 * 1024 * 1024 + 5)  # three parts of a multipart upload

    async def chunks(fail: bool = False) -> AsyncIterator[bytes]:
        for start in range(0, len(data), 1 << 20):
            yield data[start:start + (1 << 20)]
        if fail:
            raise ConnectionResetError("the client went away")

    assert await blobs.put_stream("files/a", chunks()) == len(data)
    assert s3.keys() == ["some/prefix/files/a"]
    assert await blobs.get("files/a") == data
    assert b"".join([chunk async for chunk in await blobs.stream("files/a")]) == data
    with pytest.raises(ConnectionResetError):  # the source's own failure, as it was
        await blobs.put_stream("files/b", chunks(fail=True))
    assert s3.keys() == ["some/prefix/files/a"] and s3.unfinished_uploads() == []
    await blobs.put("files/c", b"small")
    assert await blobs.get("files/c") == b"small"
    await blobs.delete("files/a")
    await blobs.delete("files/a")  # (gone already: no error)
    with pytest.raises(BlobNotFound):
        await blobs.get("files/a")
    with pytest.raises(BlobStoreError) as failed:
        await open_blob_store("s3://no-such-bucket-here").put("files/x", b"x")
    assert "no-such-bucket" not in str(failed.value) and "127.0.0.1" not in str(failed.value)


async def test_files_through_the_router_on_s3(fleet: OpsFleet, s3: S3Bucket) -> None:
    await fleet.start({}, config=files_config(fleet, storage=f"s3://{s3.name}/router"))
    async with client(fleet.url) as api:
        made = await api.files.create(file=("in.jsonl", LINES * 10), purpose="batch")
        assert s3.keys() == [f"router/files/{made.id}", f"router/records/{made.id}.json"]
        assert (await api.files.content(made.id)).content == LINES * 10
        await api.files.delete(made.id)
    assert s3.keys() == []
