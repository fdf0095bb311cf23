"""OpenAI's Batch API: `POST /v1/batches`, `GET /v1/batches`, `GET /v1/batches/{id}`,
`POST /v1/batches/{id}/cancel`, in OpenAI's shapes; the batches run on every replica's
`router.batch.runner.BatchRunner`.

A tenant (the API key's) sees only its own batches and files; another tenant's batch is
answered as an unknown one (404). Without API keys configured everything belongs to one
anonymous owner. Each call (and each Files API call) is one request against the key's and
the tenant's `requests_per_min` (`admitted`): 429 with Retry-After beyond them.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable
from dataclasses import replace
from typing import Any, TypeVar

from aiohttp import StreamReader, web

from router.admission.gate import Admission
from router.auth.config import AuthConfig
from router.auth.keys import Principal
from router.batch.files import FileStore, FilesUnavailable
from router.batch.lines import BATCH_ENDPOINTS
from router.batch.record import Batch, new_batch_id
from router.batch.state import BatchesUnavailable, BatchStore
from router.config_reload import ConfigHolder
from router.core.errors import ApiError
from router.core.parse import ParsedRequest

COMPLETION_WINDOWS = {"24h": 24 * 3600}
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_CREATE_BODY_BYTES = 64 * 1024
DEFAULT_PAGE = 20
MAX_PAGE = 100
T = TypeVar("T")
# What a Files or Batch API call is charged: one request, no tokens.
_ONE_REQUEST = ParsedRequest(model="", stream=False, prompt_tokens=0, completion_tokens=0)


def _unavailable() -> ApiError:
    return ApiError(503, "batches cannot be reached right now; retry shortly",
                    code="store_unavailable", headers={"Retry-After": "1"})


class UploadStalled(Exception):
    """The client sent nothing of its request's body for `router.client_timeouts.body_s`."""


class ClientReads:
    """Reads of a request's body, each cut off (`UploadStalled`) when no byte of it
    arrives for `idle_s`: a long upload may take as long as it needs while it sends."""

    def __init__(self, content: StreamReader, idle_s: float) -> None:
        self._content = content
        self._idle_s = idle_s

    async def __call__(self, read: Awaitable[T]) -> T:
        # Never cancelled while bytes still come (that would lose what it read): waited
        # for again as long as the body grew meanwhile, also by bytes that came while the
        # host stalled this process (fed before the timer fires).
        reading = asyncio.ensure_future(read)
        content = self._content
        try:
            seen = -1
            while seen != content.total_bytes:
                seen = content.total_bytes
                await asyncio.wait((reading,), timeout=self._idle_s)
                if reading.done():
                    return reading.result()
        finally:
            if not reading.done():  # ended before the body may be read on (aiohttp drains it)
                reading.cancel()
                await asyncio.wait((reading,))
        raise UploadStalled


async def admitted(admission: Admission | None, request: web.Request, auth: AuthConfig
                   ) -> tuple[Principal | None, dict[str, str] | None]:
    """The caller of a Files or Batch API call (None without API keys; 401) and the
    x-ratelimit-* headers for its answer, once the call is charged as one request against
    the key's and the tenant's request limits (429 with Retry-After beyond them, as for
    inference). Token limits do not apply, nor the key's list of models."""
    if admission is None:
        return None, None
    principal = admission.authenticate(request.headers, auth)
    if principal is None:
        return None, None
    rate_headers = await admission.admit(replace(principal, allowed_models=None),
                                         _ONE_REQUEST, auth)
    return principal, rate_headers


def _not_found(batch_id: str) -> ApiError:
    return ApiError(404, f"No batch found with id '{batch_id[:64]}'.", code="not_found")


class BatchesApi:
    """The HTTP side of batches (see the module doc)."""

    def __init__(self, store: BatchStore, files: FileStore, admission: Admission | None,
                 configs: ConfigHolder) -> None:
        self.store = store
        self.files = files
        self.admission = admission
        self.configs = configs

    async def _caller(self, request: web.Request
                      ) -> tuple[Principal | None, dict[str, str] | None]:
        """The caller's principal and its x-ratelimit-* headers (`admitted`: 401, 429);
        404 when the Batch API is switched off."""
        config = self.configs.current
        if not config.batch.enabled:
            raise ApiError(404, "the Batch API is not enabled on this router")
        return await admitted(self.admission, request, config.auth)

    async def create(self, request: web.Request) -> web.Response:
        principal, rate_headers = await self._caller(request)
        body = await _json_body(request, self.configs.current.router.client_timeouts.body_s)
        endpoint = body.get("endpoint")
        if not isinstance(endpoint, str) or endpoint not in BATCH_ENDPOINTS:
            raise ApiError(400, f"'endpoint' must be one of {', '.join(BATCH_ENDPOINTS)}",
                           param="endpoint")
        window = body.get("completion_window")
        if not isinstance(window, str) or window not in COMPLETION_WINDOWS:
            raise ApiError(400, "'completion_window' must be \"24h\"",
                           param="completion_window")
        metadata = _metadata(body.get("metadata"))
        input_file_id = body.get("input_file_id")
        owner = None if principal is None else principal.tenant
        if not isinstance(input_file_id, str) or not input_file_id:
            raise ApiError(400, "'input_file_id' is required", param="input_file_id")
        try:
            record = await self.files.get(input_file_id, owner)
        except FilesUnavailable:
            raise _unavailable() from None
        if record is None:
            raise ApiError(400, f"No such File object: {input_file_id[:64]}",
                           param="input_file_id")
        if record.purpose != "batch":
            raise ApiError(400, f"the file {input_file_id} was uploaded with purpose "
                           f"'{record.purpose}'; a batch's input needs purpose 'batch'",
                           param="input_file_id")
        max_lines = self.configs.current.batch.max_lines
        if record.lines > max_lines:
            raise ApiError(400, f"the input file has {record.lines} lines; a batch takes at "
                           f"most {max_lines} requests", code="too_many_lines",
                           param="input_file_id")
        limit = self.configs.current.batch.max_unfinished_per_tenant
        try:
            unfinished = await self.store.unfinished(owner)
        except BatchesUnavailable:
            raise _unavailable() from None
        if unfinished >= limit:
            raise ApiError(429, f"{unfinished} batches of yours have not finished; at most "
                           f"{limit} may run at once: wait for one to end, or cancel one",
                           code="batch_limit_reached")
        created = int(time.time())
        doc = {"id": new_batch_id(), "endpoint": endpoint, "input_file_id": input_file_id,
               "completion_window": window, "created_at": created,
               "expires_at": created + COMPLETION_WINDOWS[window], "metadata": metadata,
               "owner": owner, "key_id": None if principal is None else principal.key_id}
        try:
            batch = await self.store.create(doc)
        except BatchesUnavailable:
            raise _unavailable() from None
        return web.json_response(batch.to_openai(), headers=rate_headers)

    async def retrieve(self, request: web.Request) -> web.Response:
        batch, rate_headers = await self._batch(request)
        return web.json_response(batch.to_openai(), headers=rate_headers)

    async def cancel(self, request: web.Request) -> web.Response:
        batch, rate_headers = await self._batch(request)
        try:
            if not await self.store.cancel(batch.id):
                raise ApiError(409, f"Cannot cancel a batch with status '{batch.status}'.",
                               code="batch_not_cancellable")
            cancelled = await self.store.get(batch.id, batch.owner)
        except BatchesUnavailable:
            raise _unavailable() from None
        return web.json_response((cancelled or batch).to_openai(), headers=rate_headers)

    async def list(self, request: web.Request) -> web.Response:
        principal, rate_headers = await self._caller(request)
        query = request.query
        try:
            limit = int(query.get("limit", DEFAULT_PAGE))
        except ValueError:
            limit = -1
        if not 1 <= limit <= MAX_PAGE:
            raise ApiError(400, f"'limit' must be an integer from 1 to {MAX_PAGE}",
                           param="limit")
        after = query.get("after") or None
        try:
            batches, more = await self.store.page(
                None if principal is None else principal.tenant, limit, after)
        except BatchesUnavailable:
            raise _unavailable() from None
        data = [batch.to_openai() for batch in batches]
        return web.json_response({
            "object": "list", "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more},
            headers=rate_headers)

    async def _batch(self, request: web.Request
                     ) -> tuple[Batch, dict[str, str] | None]:
        principal, rate_headers = await self._caller(request)
        batch_id = request.match_info["batch_id"]
        if not batch_id.startswith("batch_") or len(batch_id) > 64:
            raise _not_found(batch_id)
        try:
            batch = await self.store.get(batch_id, None if principal is None
                                         else principal.tenant)
        except BatchesUnavailable:
            raise _unavailable() from None
        if batch is None:
            raise _not_found(batch_id)
        return batch, rate_headers


async def _json_body(request: web.Request, idle_s: float) -> dict[str, Any]:
    if (request.content_length or 0) > MAX_CREATE_BODY_BYTES:
        raise ApiError(413, f"request body is too large (limit {MAX_CREATE_BODY_BYTES} bytes)")
    parts: list[bytes] = []
    size = 0
    reads = ClientReads(request.content, idle_s)
    while chunk := await _within(reads, request.content.readany(), idle_s):
        size += len(chunk)
        if size > MAX_CREATE_BODY_BYTES:
            raise ApiError(413, f"request body is too large (limit {MAX_CREATE_BODY_BYTES} "
                           "bytes)")
        parts.append(chunk)
    raw = b"".join(parts)
    try:
        body = json.loads(raw)
    except ValueError:
        raise ApiError(400, "request body must be JSON") from None
    except RecursionError:  # (nested too deeply for json: a client's fault, not a 500)
        raise ApiError(400, "request body must be JSON, not nested that deeply") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    return body


async def _within(reads: ClientReads, read: Awaitable[bytes], idle_s: float) -> bytes:
    try:
        return await reads(read)
    except UploadStalled:
        raise ApiError(408, f"the request body stopped: nothing of it arrived for "
                       f"{idle_s:g} s") from None


def _metadata(value: Any) -> dict[str, str] | None:
    """OpenAI's metadata: up to 16 string pairs (keys up to 64 characters, values 512)."""
    if value is None:
        return None
    if (not isinstance(value, dict) or len(value) > MAX_METADATA_PAIRS
            or not all(isinstance(k, str) and isinstance(v, str)
                       and len(k) <= MAX_METADATA_KEY_CHARS
                       and len(v) <= MAX_METADATA_VALUE_CHARS for k, v in value.items())):
        raise ApiError(400, f"'metadata' must be an object of at most {MAX_METADATA_PAIRS} "
                       f"string pairs (keys up to {MAX_METADATA_KEY_CHARS} characters, values "
                       f"up to {MAX_METADATA_VALUE_CHARS})", param="metadata")
    return dict(value)
