"""The Responses API's stored responses: each found at the worker that holds it.

`POST /v1/responses` is routed by model like chat (router.proxy.handlers). What this
module adds, around it:

- a create whose answer the engine stores (`store`, true by default) has its holder
  recorded (router.registry.response_store) once the answer names its id: a whole
  answer's `id`, or a stream's first event (`response.created`), as it starts;
- a create that continues a stored response (`previous_response_id`) goes to that
  response's worker only (`RouteRequest.only_worker`), from any replica in any region,
  residency respected;
- `GET /v1/responses/{id}`, `POST /v1/responses/{id}/cancel` (and whatever else vLLM
  serves below `/v1/responses/{id}`) go to the holder as they came (query included), the
  answer back as the worker sends it (a stream passed on as it arrives).

A response that no record names (never stored, another tenant's, expired), or whose
worker has left the fleet or no longer has it (a restarted engine answers 404), is
answered as OpenAI answers an unknown id: 404 `Response with id '...' not found.`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping

from aiohttp import web

from router.admission.gate import Admission
from router.auth.keys import Principal
from router.config_reload import ConfigHolder
from router.core.errors import ApiError
from router.core.outcome import Attempt, RequestRecord
from router.core.parse import ParsedRequest, valid_response_id
from router.proxy.exchange import Reply
from router.proxy.failures import UpstreamFailure, client_error_body
from router.proxy.send import read_all, send
from router.proxy.targets import target_of, upstream_headers
from router.proxy.timeouts import Deadline
from router.proxy.upstream.connection import UpstreamConnection
from router.proxy.upstream.errors import UpstreamError
from router.proxy.upstream.pool import UpstreamPool
from router.proxy.upstream.request import RequestHead
from router.proxy.worker_auth import WorkerAuth
from router.registry.response_store import ResponseHolder, ResponseStore, StoreUnavailable
from router.registry.snapshot import SnapshotHolder
from router.registry.worker_view import WorkerView

RESPONSES_PATH = "/v1/responses"
_MAX_ID_EVENT_BYTES = 64 * 1024  # where a stream's first event must name its response


def not_found(response_id: str, *, previous: bool = False) -> ApiError:
    """OpenAI's answer for an unknown response id."""
    if previous:
        return ApiError(404, f"Previous response with id '{response_id}' not found.",
                        code="previous_response_not_found", param="previous_response_id")
    return ApiError(404, f"Response with id '{response_id}' not found.")


def _unavailable() -> ApiError:
    return ApiError(503, "stored responses cannot be looked up right now; retry shortly",
                    code="store_unavailable", headers={"Retry-After": "1"})


def id_in_body(body: bytes) -> str | None:
    """The response id of a whole Responses answer (`{"id": "resp_...", ...}`)."""
    try:
        document = json.loads(body)
    except ValueError:
        return None
    found = document.get("id") if isinstance(document, dict) else None
    return found if isinstance(found, str) and valid_response_id(found) else None


def id_in_first_event(first: bytes) -> str | None:
    """The response id in a Responses stream's first event (`response.created`, whose
    data holds the response)."""
    for line in first[:_MAX_ID_EVENT_BYTES].split(b"\n"):
        if line.startswith(b"data:"):
            try:
                document = json.loads(line[5:])
            except ValueError:
                return None
            response = document.get("response") if isinstance(document, dict) else None
            found = response.get("id") if isinstance(response, dict) else None
            return found if isinstance(found, str) and valid_response_id(found) else None
    return None


class StoredResponse:
    """One create whose answer the engine stores: its holder is recorded once the answer
    names its id (`first_event` for a stream, as it starts; `finished` for a whole
    answer, before the client gets it)."""

    __slots__ = ("_api", "_model", "_owner", "_task")

    def __init__(self, api: ResponsesApi, model: str, owner: str | None) -> None:
        self._api = api
        self._model = model
        self._owner = owner
        self._task: asyncio.Task[None] | None = None

    def first_event(self, first: bytes, attempt: Attempt) -> None:
        """A stream's first event: its holder recorded meanwhile (done long before the
        stream ends, when the client could ask another replica about it)."""
        self._task = self._api.recording(id_in_first_event(first), self._holder(attempt))

    async def finished(self, reply: Reply, record: RequestRecord) -> None:
        """The request's answer, before it goes to the client."""
        if self._task is not None:
            await asyncio.shield(self._task)
        elif not reply.streamed and reply.status == 200 and record.served_by is not None:
            task = self._api.recording(id_in_body(reply.body), self._holder(record.served_by))
            if task is not None:
                await asyncio.shield(task)

    def _holder(self, attempt: Attempt) -> ResponseHolder:
        return ResponseHolder(attempt.worker_id, attempt.region, self._model, self._owner)


class ResponsesApi:
    """Records, finds and serves the stored responses of one router replica."""

    def __init__(self, store: ResponseStore, snapshots: SnapshotHolder, upstreams: UpstreamPool,
                 configs: ConfigHolder, admission: Admission | None) -> None:
        self.store = store
        self._snapshots = snapshots
        self._upstreams = upstreams
        self._configs = configs
        self._admission = admission
        self._worker_auth = WorkerAuth()
        self._writing: set[asyncio.Task[None]] = set()  # held: the loop keeps weak refs

    def storing(self, parsed: ParsedRequest, principal: Principal | None
                ) -> StoredResponse | None:
        """What records the holder of this create's answer, if the engine stores it."""
        if not parsed.store:
            return None
        return StoredResponse(self, parsed.model, _owner(principal))

    def recording(self, response_id: str | None, holder: ResponseHolder
                  ) -> asyncio.Task[None] | None:
        """Start recording `holder` for `response_id` (None: the answer named none)."""
        if response_id is None:
            self.store.stats.recorded["no_id"] += 1
            return None
        self.store.ttl_s = self._configs.current.router.responses.ttl_s  # (reloads)
        task = asyncio.ensure_future(self.store.record(response_id, holder))
        self._writing.add(task)
        task.add_done_callback(self._writing.discard)
        return task

    async def holder_of(self, parsed: ParsedRequest, principal: Principal | None) -> str:
        """The worker a create with `previous_response_id` must go to; ApiError(404) when
        the response is unknown or its worker gone, 503 when Redis cannot be asked."""
        previous = parsed.previous_response_id
        assert previous is not None
        holder = await self._find(previous, principal, previous=True)
        return holder.worker_id

    async def by_id(self, request: web.Request) -> web.StreamResponse:
        """Anything under /v1/responses/{response_id} (GET, cancel, ...): at its holder."""
        response_id = request.match_info["response_id"]
        if not valid_response_id(response_id):
            raise not_found(response_id[:128])
        config = self._configs.current
        admission = self._admission
        principal = (admission.authenticate(request.headers, config.auth)
                     if admission is not None else None)  # 401
        holder = await self._find(response_id, principal)
        rate_headers = None
        if admission is not None and principal is not None:
            allowed = principal.allowed_regions
            if allowed is not None and holder.region not in allowed:
                raise not_found(response_id)  # (it cannot have been created for this key)
            rate_headers = await admission.admit(principal, ParsedRequest(
                model=holder.model, stream=False, prompt_tokens=1, completion_tokens=0),
                config.auth)  # 403, 429
        view = self._snapshots.current.workers[holder.worker_id]  # (_find: it is live)
        body = await request.read() if request.can_read_body else b""
        return await self._forward(request, view, response_id, body, rate_headers)

    async def _find(self, response_id: str, principal: Principal | None, *,
                    previous: bool = False) -> ResponseHolder:
        """The holder of `response_id` for `principal`, its worker live; else ApiError."""
        stats = self.store.stats
        try:
            holder = await self.store.lookup(response_id, _owner(principal))
        except StoreUnavailable:
            raise _unavailable() from None
        if holder is None:
            raise not_found(response_id, previous=previous)
        snapshot = self._snapshots.current
        view = snapshot.workers.get(holder.worker_id)
        if view is None or not view.fresh(snapshot.freshness_now(time.monotonic())):
            stats.lookups["worker_gone"] += 1
            raise not_found(response_id, previous=previous)
        stats.lookups["found"] += 1
        return holder

    async def _forward(self, request: web.Request, view: WorkerView, response_id: str,
                       body: bytes, rate_headers: Mapping[str, str] | None
                       ) -> web.StreamResponse:
        """The request as it came (method, path, query, body) to `view`'s worker; its
        answer back, a stream as it arrives."""
        config = self._configs.current
        target = target_of(view.endpoint)
        headers = upstream_headers(request.headers)
        self._worker_auth.authorize(headers, config, view.region)
        path = target.base_path + request.rel_url.raw_path_qs
        payload = RequestHead(request.method, path, target.host_header).encode_lower(
            headers, body)
        pool = self._upstreams
        deadline = Deadline(config.router.timeouts.total_s, pool.loop)
        try:
            upstream = await send(pool, target, payload, deadline)
            answer_headers = {**(rate_headers or {}), "x-globalpool-region": view.region,
                              "x-globalpool-worker": view.worker_id,
                              "Content-Type": upstream.headers.get("content-type",
                                                                   "application/json")}
            if upstream.status != 200 or not answer_headers["Content-Type"].startswith(
                    "text/event-stream"):
                answer = await read_all(upstream)
                return self._whole(upstream.status, answer, answer_headers, response_id)
            return await _stream(request, upstream, answer_headers)
        except (UpstreamFailure, UpstreamError):
            raise ApiError(502, "the worker that holds this response did not answer",
                           code="upstream_failed") from None
        except asyncio.CancelledError:
            if deadline.timed_out():
                raise ApiError(504, "the worker that holds this response did not answer in "
                               "time", code="upstream_timeout") from None
            raise
        finally:
            deadline.cancel()

    def _whole(self, status: int, answer: bytes, headers: dict[str, str],
               response_id: str) -> web.Response:
        if status == 404:
            # The worker no longer has it (restarted, or it evicted it): as if unknown.
            self.store.stats.lookups["worker_forgot"] += 1
            raise not_found(response_id)
        if status >= 400:
            answer = client_error_body(status, answer)
            headers["Content-Type"] = "application/json"
        return web.Response(status=status, body=answer, headers=headers)


async def _stream(request: web.Request, upstream: UpstreamConnection,
                  headers: dict[str, str]) -> web.StreamResponse:
    """A stream (`GET ...?stream=true` of a background response) passed on as it arrives;
    one that breaks off ends there (the client sees no end event)."""
    response = web.StreamResponse(status=200, headers={**headers, "Cache-Control": "no-cache"})
    await response.prepare(request)
    try:
        while chunk := await upstream.read_some():
            await response.write(chunk)
    except UpstreamError:
        upstream.close()
        return response
    except BaseException:
        upstream.close()
        raise
    upstream.release()
    await response.write_eof()
    return response


def _owner(principal: Principal | None) -> str | None:
    return None if principal is None else principal.tenant
