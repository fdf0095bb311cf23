"""OpenAI's Files API: what `client.files.create / retrieve / list / content / delete` call.

    POST   /v1/files                  multipart/form-data: `purpose`, `file`  -> File
    GET    /v1/files                  ?purpose=&limit=&after=&order=          -> list
    GET    /v1/files/{file_id}                                                -> File
    GET    /v1/files/{file_id}/content                                        -> the bytes
    DELETE /v1/files/{file_id}                                                -> deleted

An upload is streamed to the blob store as it arrives (never held whole in memory) and
refused with 413 as soon as it passes `batch.max_file_bytes` (read on every request: it
follows hot reloads), leaving nothing behind. The form's fields may come in either
order: a `purpose` sent first (as OpenAI's clients do) is checked before any of the file
is read; a `file` sent first is stored, then dropped if the purpose turns out bad.

Each caller sees only its tenant's files (router.batch.files): another tenant's file is
answered as OpenAI answers an unknown id, `404 No such File object: file-...`. Each call
is a request against the key's and tenant's request limits (429; router.batch.api.
admitted); a tenant keeps at most `batch.max_files_per_tenant` files (429 at upload); an
upload whose client sends nothing for `router.client_timeouts.body_s` is answered 408,
nothing of it kept. With `batch.enabled: false` every path answers 404. Redis or the blob
store unreachable: 503 with Retry-After; an error never names a path, a bucket or a
backend's own message.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TypeVar, get_args

from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import BadHttpMessage

from router.admission.gate import Admission
from router.batch.api import ClientReads, UploadStalled, admitted
from router.batch.blobs import BlobNotFound, BlobStoreError, open_blob_store
from router.batch.files import (
    MAX_LIST_LIMIT,
    UPLOAD_PURPOSES,
    FilePage,
    FileRecord,
    FileStore,
    FilesUnavailable,
    FileTooLarge,
    Order,
    StagedFile,
    UnknownCursor,
)
from router.config_reload import ConfigHolder
from router.core.errors import ApiError
from worker import redis_client

log = logging.getLogger("globalpool.files")

FILES_PATH = "/v1/files"
# Bytes of the file read from the client at a time, and handed to the blob store.
UPLOAD_CHUNK_BYTES = 256 * 1024
# The form's other fields (`purpose`, `expires_after[...]`) are short: longer is refused.
MAX_FIELD_BYTES = 1024
MAX_FORM_PARTS = 16
# A body longer than the file limit by more than this cannot hold an acceptable file:
# refused before any of it is read.
FORM_OVERHEAD_BYTES = 64 * 1024

T = TypeVar("T")
_OUTCOMES = {400: "bad_request", 404: "not_found", 408: "stalled", 413: "too_large", 429: "limited"}


@dataclass
class FilesStats:
    """Counters for /metrics.

    `requests[(operation, outcome)]`: operation "upload", "retrieve", "list", "content",
    "delete"; outcome "ok"; "bad_request" (400); "not_found" (404: unknown, or another
    tenant's); "stalled" (408: an upload the client stopped sending); "too_large" (413);
    "limited" (429: a rate limit, or the tenant's file count); "unavailable" (503: Redis
    or the blob store); "content_missing" (a record whose content the store has not);
    "cut_short" (a download the store failed in the middle of).
    `transferred_bytes`: "uploaded", "downloaded".
    """

    requests: Counter[tuple[str, str]] = field(default_factory=Counter)
    transferred_bytes: Counter[str] = field(default_factory=Counter)


@dataclass
class _Form:
    """What an upload's form has given so far: its file is `staged` when it came before
    the purpose (stored, not yet a file), a `record` when after."""

    purpose: str | None = None
    filename: str | None = None
    staged: StagedFile | None = None
    record: FileRecord | None = None


def not_found(file_id: str) -> ApiError:
    """OpenAI's answer for an unknown file id (and for another tenant's)."""
    return ApiError(404, f"No such File object: {file_id[:100]}", param="id")


class FilesApi:
    """The Files API's handlers (see the module doc); `add_routes` registers them."""

    def __init__(self, store: FileStore, admission: Admission | None, configs: ConfigHolder,
                 stats: FilesStats | None = None) -> None:
        self.store = store
        self._admission = admission
        self._configs = configs
        self.stats = stats or FilesStats()

    async def upload(self, request: web.Request) -> web.Response:
        """POST /v1/files."""
        owner, rate_headers = await self._caller(request, "upload")
        record = await self._counted("upload", self._upload(request, owner))
        self.stats.requests["upload", "ok"] += 1
        self.stats.transferred_bytes["uploaded"] += record.size_bytes
        return web.json_response(record.to_openai(), headers=rate_headers)

    async def retrieve(self, request: web.Request) -> web.Response:
        """GET /v1/files/{file_id}."""
        owner, rate_headers = await self._caller(request, "retrieve")
        record = await self._counted("retrieve", self._record(request, owner))
        self.stats.requests["retrieve", "ok"] += 1
        return web.json_response(record.to_openai(), headers=rate_headers)

    async def list_files(self, request: web.Request) -> web.Response:
        """GET /v1/files: the caller's files, newest first unless `order=asc`."""
        owner, rate_headers = await self._caller(request, "list")
        page = await self._counted("list", self._page(request, owner))
        self.stats.requests["list", "ok"] += 1
        return web.json_response(page.to_openai(), headers=rate_headers)

    async def content(self, request: web.Request) -> web.StreamResponse:
        """GET /v1/files/{file_id}/content: the bytes as uploaded, streamed."""
        owner, rate_headers = await self._caller(request, "content")
        record = await self._counted("content", self._record(request, owner))
        try:
            chunks = await self._counted("content", self.store.open(record.id))
        except BlobNotFound:
            self.stats.requests["content", "content_missing"] += 1
            raise ApiError(500, f"the content of {record.id} is missing from this router's "
                           "file storage", code="file_content_missing") from None
        response = web.StreamResponse(headers={**(rate_headers or {}),
                                               "Content-Type": "application/octet-stream"})
        response.content_length = record.size_bytes
        await response.prepare(request)
        try:
            async for chunk in chunks:
                await response.write(chunk)
                self.stats.transferred_bytes["downloaded"] += len(chunk)
        except BlobStoreError:
            # Too late for an error: the connection closes, the client sees a short body.
            self.stats.requests["content", "cut_short"] += 1
            raise
        await response.write_eof()
        self.stats.requests["content", "ok"] += 1
        return response

    async def delete(self, request: web.Request) -> web.Response:
        """DELETE /v1/files/{file_id}."""
        owner, rate_headers = await self._caller(request, "delete")
        file_id = request.match_info["file_id"]
        if not await self._counted("delete", self.store.delete(file_id, owner)):
            self.stats.requests["delete", "not_found"] += 1
            raise not_found(file_id)
        self.stats.requests["delete", "ok"] += 1
        return web.json_response({"id": file_id, "object": "file", "deleted": True},
                                 headers=rate_headers)

    # -- the parts --
    async def _caller(self, request: web.Request, operation: str
                      ) -> tuple[str | None, dict[str, str] | None]:
        """The caller's tenant (None without API keys) and its x-ratelimit-* headers, the
        call charged as one request (`admitted`). Raises ApiError: 404 when the Files API
        is off, 401, 429."""
        config = self._configs.current
        if not config.batch.enabled:
            raise ApiError(404, "the Files API is not enabled on this router")
        principal, rate_headers = await self._counted(
            operation, admitted(self._admission, request, config.auth))
        return None if principal is None else principal.tenant, rate_headers

    async def _room_for_one_more(self, owner: str | None) -> None:
        """ApiError(429) when `owner` has `batch.max_files_per_tenant` files (uploads at
        the same moment may pass it by a few); FilesUnavailable."""
        limit = self._configs.current.batch.max_files_per_tenant
        stored = await self.store.count(owner)
        if stored >= limit:
            raise ApiError(429, f"you have {stored} files stored; at most {limit} may be "
                           "kept: delete some before uploading more",
                           code="file_limit_reached", param="file")

    async def _record(self, request: web.Request, owner: str | None) -> FileRecord:
        file_id = request.match_info["file_id"]
        record = await self.store.get(file_id, owner)
        if record is None:
            raise not_found(file_id)
        return record

    async def _page(self, request: web.Request, owner: str | None) -> FilePage:
        query = request.query
        limit = _limit(query.get("limit"))
        order = query.get("order", "desc")
        if order not in get_args(Order):
            raise ApiError(400, "order must be 'asc' or 'desc'", param="order")
        after = query.get("after") or None
        try:
            return await self.store.list(owner, purpose=query.get("purpose") or None,
                                         limit=limit, after=after,
                                         order="asc" if order == "asc" else "desc")
        except UnknownCursor:
            raise ApiError(400, f"after: {after!r:.80} is not one of your files (deleted "
                           "meanwhile?); list again from the start", param="after") from None

    async def _upload(self, request: web.Request, owner: str | None) -> FileRecord:
        """The form read part by part: the file streamed to storage, the rest checked.
        Whatever fails, nothing of the upload is kept."""
        max_bytes = self._configs.current.batch.max_file_bytes
        if request.content_type != "multipart/form-data":
            raise ApiError(400, "upload the file as multipart/form-data with the fields "
                           "'purpose' and 'file'")
        length = request.content_length
        if length is not None and length > max_bytes + FORM_OVERHEAD_BYTES:
            raise _too_large(max_bytes)
        await self._room_for_one_more(owner)
        idle_s = self._configs.current.router.client_timeouts.body_s
        form = _Form()
        try:
            await self._read_form(request, owner, max_bytes, form,
                                  ClientReads(request.content, idle_s))
            if form.purpose is None:
                raise ApiError(400, "missing the 'purpose' field: one of "
                               f"{', '.join(UPLOAD_PURPOSES)}", param="purpose")
        except FileTooLarge as exc:
            await self._discard(form)
            raise _too_large(exc.max_bytes) from None
        except UploadStalled:
            await self._discard(form)
            raise ApiError(408, f"the upload stopped: nothing of it arrived for {idle_s:g} s",
                           code="upload_timed_out") from None
        except (ValueError, BadHttpMessage):
            await self._discard(form)
            raise ApiError(400, "the multipart/form-data body is malformed") from None
        except BaseException:
            await self._discard(form)
            raise
        if form.record is not None:
            return form.record
        if form.staged is None:
            raise ApiError(400, "missing the 'file' field: send the file's content as a "
                           "multipart part named 'file'", param="file")
        return await self.store.commit(form.staged, owner, form.filename, form.purpose)

    async def _read_form(self, request: web.Request, owner: str | None, max_bytes: int,
                         form: _Form, reads: ClientReads) -> None:
        reader = await request.multipart()
        for _ in range(MAX_FORM_PARTS):
            part = await reads(reader.next())
            if part is None:
                return
            if not isinstance(part, BodyPartReader):
                raise ApiError(400, "a nested multipart part is not expected here")
            if part.name == "file":
                if form.staged is not None or form.record is not None:
                    raise ApiError(400, "one file per upload", param="file")
                chunks = _part_chunks(part, reads)
                if form.purpose is None:  # not known yet: stored, then checked
                    form.filename = part.filename
                    form.staged = await self.store.upload(chunks, max_bytes)
                else:
                    form.record = await self.store.create(
                        owner, part.filename, form.purpose, chunks, max_bytes)
            elif part.name == "purpose":
                if form.purpose is not None:
                    raise ApiError(400, "'purpose' is given twice", param="purpose")
                form.purpose = _checked_purpose(await _field_text(part, "purpose", reads))
            else:  # OpenAI's `expires_after[...]`, and the like: not kept here
                await _field_text(part, part.name or "field", reads)
        raise ApiError(400, f"more than {MAX_FORM_PARTS} fields in the form")

    async def _discard(self, form: _Form) -> None:
        """Drop what an upload that is refused after all has stored."""
        if form.staged is not None:
            await self.store.discard(form.staged)
        record = form.record
        if record is not None:
            try:
                await self.store.delete(record.id, record.owner)
            except (FilesUnavailable, BlobStoreError) as exc:  # its owner can delete it
                log.warning("file %s: stored, but its upload was refused after all; it "
                            "could not be deleted (%s)", record.id, type(exc).__name__)

    async def _counted(self, operation: str, call: Awaitable[T]) -> T:
        """Await `call`, its refusals counted by kind, and the failures of Redis or the
        blob store turned into 503s."""
        try:
            return await call
        except FilesUnavailable:
            self.stats.requests[operation, "unavailable"] += 1
            raise ApiError(503, "files cannot be looked up right now; retry shortly",
                           code="files_unavailable", headers={"Retry-After": "1"}) from None
        except BlobNotFound:
            raise
        except BlobStoreError as exc:
            self.stats.requests[operation, "unavailable"] += 1
            raise ApiError(503, f"{exc}; retry shortly", code="storage_unavailable",
                           headers={"Retry-After": "1"}) from None
        except ApiError as exc:
            self.stats.requests[operation, _OUTCOMES.get(exc.status, str(exc.status))] += 1
            raise


@asynccontextmanager
async def opened(redis_url: str, admission: Admission | None, configs: ConfigHolder,
                 keys: Mapping[str, bytes] | None = None) -> AsyncIterator[FilesApi]:
    """The Files API with a Redis pool of its own and the blob store that `batch.storage`
    names (read here only: changing it takes a restart); the pool closed after. `keys`:
    the heartbeat keys, which sign its records (FileStore)."""
    config = configs.current
    redis = redis_client.connect(redis_url)
    try:
        store = FileStore(redis, redis_client.one_slot_prefix(config.redis.key_prefix, redis_url),
                          open_blob_store(config.batch.storage), keys=keys)
        yield FilesApi(store, admission, configs)
    finally:
        await redis.aclose()


def add_routes(app: web.Application, api: Callable[[web.Application], FilesApi]) -> None:
    """Register the Files API's routes on `app` (before it starts: the FilesApi itself is
    built when it does, and found by `api(app)`)."""

    def route(handler: Callable[[FilesApi, web.Request], Awaitable[web.StreamResponse]]
              ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def serve(request: web.Request) -> web.StreamResponse:
            return await handler(api(request.app), request)
        return serve

    app.router.add_post(FILES_PATH, route(FilesApi.upload))
    app.router.add_get(FILES_PATH, route(FilesApi.list_files))
    app.router.add_get(FILES_PATH + "/{file_id}", route(FilesApi.retrieve))
    app.router.add_delete(FILES_PATH + "/{file_id}", route(FilesApi.delete))
    app.router.add_get(FILES_PATH + "/{file_id}/content", route(FilesApi.content))


def _too_large(max_bytes: int) -> ApiError:
    return ApiError(413, f"the file is larger than this router accepts: at most "
                    f"{_size(max_bytes)} ({max_bytes} bytes)", code="file_too_large",
                    param="file")


def _size(size_bytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size_bytes >= scale:
            return f"{size_bytes / scale:.4g} {unit}"
    return f"{size_bytes} bytes"


def _limit(raw: str | None) -> int:
    if raw is None:
        return MAX_LIST_LIMIT
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 6
            and 1 <= int(raw) <= MAX_LIST_LIMIT):
        raise ApiError(400, f"limit must be a whole number from 1 to {MAX_LIST_LIMIT}",
                       param="limit")
    return int(raw)


def _checked_purpose(purpose: str) -> str:
    if purpose not in UPLOAD_PURPOSES:
        raise ApiError(400, f"{purpose[:40]!r} is not a purpose files can be uploaded with: "
                       f"one of {', '.join(UPLOAD_PURPOSES)}", param="purpose")
    return purpose


async def _field_text(part: BodyPartReader, name: str, reads: ClientReads) -> str:
    """A short form field's value. Raises ApiError(400) past MAX_FIELD_BYTES."""
    value = bytearray()
    while chunk := await reads(part.read_chunk(MAX_FIELD_BYTES + 1)):
        value += chunk
        if len(value) > MAX_FIELD_BYTES:
            raise ApiError(400, f"the field {name[:40]!r} is longer than {MAX_FIELD_BYTES} "
                           "bytes", param=name[:40])
    try:
        return value.decode()
    except UnicodeDecodeError:
        raise ApiError(400, f"the field {name[:40]!r} is not UTF-8", param=name[:40]) from None


async def _part_chunks(part: BodyPartReader, reads: ClientReads) -> AsyncIterator[bytes]:
    """The file part's bytes as they arrive."""
    while chunk := await reads(part.read_chunk(UPLOAD_CHUNK_BYTES)):
        yield chunk
