"""The OpenAI-compatible endpoints: validate, route, forward, retry before the first byte."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from router.config import GlobalConfig
from router.policy import NoRoute, Policy, RouteRequest
from router.policy.inflight import InFlight
from router.proxy.errors import ApiError, error_response
from router.proxy.forward import UpstreamFailure, forward_stream, forward_unary, upstream_headers
from router.proxy.outcome import Attempt, Observer, RequestRecord
from router.proxy.parse import ParsedRequest, parse_body
from router.registry.snapshot import SnapshotHolder

log = logging.getLogger("globalpool.proxy")

REGION_HEADER = "x-globalpool-region"
WORKER_HEADER = "x-globalpool-worker"
CLIENT_REGION_HEADER = "x-globalpool-client-region"

_KIND_BY_PATH = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
}


@dataclass
class Proxy:
    """Everything the request path needs; built once per app by `router.app`."""

    config: GlobalConfig
    region: str | None
    holder: SnapshotHolder
    policy: Policy
    inflight: InFlight
    session: aiohttp.ClientSession
    observers: tuple[Observer, ...] = ()

    async def inference(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions, /v1/completions, /v1/embeddings."""
        received_s = time.monotonic()
        router_config = self.config.router
        if (request.content_length or 0) > router_config.max_body_bytes:
            limit = router_config.max_body_bytes
            raise ApiError(413, f"request body is too large (limit {limit} bytes)")
        body = await request.read()
        kind = _KIND_BY_PATH[request.path]
        parsed = parse_body(body, kind)
        origin = self._origin_region(request)
        record = RequestRecord(model=parsed.model, kind=kind, stream=parsed.stream,
                               origin_region=origin, received_s=received_s)
        try:
            response = await self._route_and_forward(request, body, parsed, record)
        except BaseException:
            record.status = 499  # the client went away (handler cancelled)
            raise
        else:
            record.status = response.status
            return response
        finally:
            record.finished_s = time.monotonic()
            for observer in self.observers:
                observer.request_finished(record)

    async def _route_and_forward(
        self, request: web.Request, body: bytes, parsed: ParsedRequest, record: RequestRecord
    ) -> web.StreamResponse:
        router_config = self.config.router
        headers = upstream_headers(request)
        tried: set[str] = set()
        failure: UpstreamFailure | None = None
        for _attempt in range(router_config.max_attempts):
            route = RouteRequest(
                model=parsed.model,
                origin_region=record.origin_region,
                prompt_tokens=parsed.prompt_tokens,
                stream=parsed.stream,
                exclude=frozenset(tried),
            )
            try:
                decision = self.policy.pick(self.holder.current, route)
            except NoRoute as exc:
                if failure is not None:
                    break  # report the upstream failure, not "nothing left to try"
                record.error = exc.reason
                return _no_route(exc, configured=parsed.model in self.config.models)
            worker = decision.worker
            tried.add(worker.worker_id)
            now = time.monotonic()
            if record.routed_s is None:
                record.routed_s = now
            attempt = Attempt(worker_id=worker.worker_id, region=worker.region,
                              predicted_ttft_ms=decision.predicted_ttft_ms,
                              reason=decision.reason if not record.attempts else "retry",
                              started_s=now)
            record.attempts.append(attempt)
            reply_headers = {
                REGION_HEADER: worker.region,
                WORKER_HEADER: worker.worker_id,
                "server-timing": _server_timing(record, attempt),
            }
            url = worker.endpoint.rstrip("/") + request.path
            self.inflight.started(worker.worker_id)
            try:
                if parsed.stream:
                    return await forward_stream(request, self.session, url, body, headers,
                                                router_config.timeouts, reply_headers, attempt)
                return await forward_unary(self.session, url, body, headers,
                                           router_config.timeouts, reply_headers, attempt)
            except UpstreamFailure as exc:
                log.warning("attempt on %s (%s) failed before first byte: %s",
                            worker.worker_id, worker.region, exc.message)
                attempt.failure = exc.kind
                attempt.status = exc.status
                failure = exc
            finally:
                self.inflight.finished(worker.worker_id)
                attempt.finished_s = time.monotonic()
                for observer in self.observers:
                    observer.attempt_finished(attempt)
        assert failure is not None
        record.error = failure.message
        status = failure.status if failure.status in (502, 503, 504) else 502
        return error_response(
            status,
            f"the request failed on {len(tried)} worker(s); last error: {failure.message}",
            code="upstream_failed",
            headers={"Retry-After": "1"},
        )

    def _origin_region(self, request: web.Request) -> str | None:
        named = request.headers.get(CLIENT_REGION_HEADER)
        if named is None:
            return self.region
        if named not in self.config.regions:
            raise ApiError(400, f"{CLIENT_REGION_HEADER}: no region named {named!r}")
        return named

    async def models(self, request: web.Request) -> web.Response:
        """GET /v1/models: the union of models served by live workers in every region."""
        created = int(time.time())
        data = [
            {"id": model, "object": "model", "created": created, "owned_by": "globalpool"}
            for model in self.holder.current.models(time.monotonic())
        ]
        return web.json_response({"object": "list", "data": data})

    async def health(self, request: web.Request) -> web.Response:
        """GET /health: the router is up; says how current its view of the fleet is."""
        snapshot = self.holder.current
        now = time.monotonic()
        age = snapshot.view_age_s(now)
        return web.json_response({
            "status": "ok",
            "region": self.region,
            "workers": len(snapshot.workers),
            "redis_connected": snapshot.redis_connected,
            "view_age_s": None if age is None else round(age, 3),
        })


def _no_route(exc: NoRoute, *, configured: bool) -> web.Response:
    if not exc.model_known and not configured:
        return error_response(404, f"The model does not exist or is not served: {exc.reason}",
                              code="model_not_found", param="model")
    return error_response(503, f"no capacity: {exc.reason}", code="no_capacity",
                          headers={"Retry-After": "1"})


def _server_timing(record: RequestRecord, attempt: Attempt) -> str:
    """`server-timing` before the answer starts: router time so far, by phase, in ms.

    `route` is arrival -> first routing decision (body read, validation, policy);
    `retry` is time spent on earlier failed attempts. The upstream's own time shows in
    the client's TTFB minus these.
    """
    routed = record.routed_s if record.routed_s is not None else attempt.started_s
    parts = [f"route;dur={(routed - record.received_s) * 1000:.3f}"]
    if len(record.attempts) > 1:
        parts.append(f"retry;dur={(attempt.started_s - routed) * 1000:.3f}")
    return ", ".join(parts)
