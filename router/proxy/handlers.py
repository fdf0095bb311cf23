"""The OpenAI-compatible endpoints: validate, route, forward, retry before the first byte."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from aiohttp import web

from router.admission.gate import Admission
from router.admission.queue import QueueFull, RouterQueue
from router.auth.keys import Principal
from router.config import GlobalConfig, RouterConfig
from router.config_reload import ConfigHolder
from router.core.errors import ApiError
from router.core.outcome import Attempt, Failure, Observer, RequestRecord
from router.core.parse import PREFIX_TOKENS, ParsedRequest, parse_body
from router.health import Health, RetryBudget
from router.policy import Decision, NoRoute, Policy, RouteRequest
from router.proxy.continuation import FAILOVER_HEADER, Failover, Rewriter
from router.proxy.exchange import Exchange, Reply, api_error_reply, error_reply
from router.proxy.forward import (
    StreamBroken,
    Target,
    UpstreamFailure,
    continue_stream,
    end_broken_stream,
    forward_stream,
    forward_unary,
    target_of,
    upstream_headers,
    upstream_key,
)
from router.proxy.request_id import request_id_of
from router.proxy.trace_context import continuation_span, inject_current_trace
from router.proxy.transcript import event_limit
from router.proxy.upstream.pool import UpstreamPool
from router.registry.drains import DrainHolder
from router.registry.inflight import InFlight
from router.registry.snapshot import SnapshotHolder

log = logging.getLogger("globalpool.proxy")

REGION_HEADER = "x-globalpool-region"
WORKER_HEADER = "x-globalpool-worker"
CLIENT_REGION_HEADER = "x-globalpool-client-region"
ROUTE_HEADER = "x-globalpool-route"  # why this worker: local, spillover, affinity, batch...
BUDGET_HEADER = "x-globalpool-budget"  # met | missed, when the request sent a TTFT budget
SESSION_HEADER = "x-globalpool-session-id"
CLASS_HEADER = "x-globalpool-class"  # interactive (default) | batch
TTFT_BUDGET_HEADER = "x-globalpool-ttft-budget-ms"
TRAFFIC_CLASSES = ("interactive", "batch")

REQUEST_ID_HEADER = "x-request-id"  # the client's own (if sane), else the router's

_UNREAD = "\x00unread"  # not a header value (a NUL cannot be in one)

_KIND_BY_PATH = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
}


@dataclass
class Proxy:
    """Everything the request path needs; built once per app by `router.app`."""

    configs: ConfigHolder  # read once per request: a reload never changes one in flight
    region: str | None
    holder: SnapshotHolder
    policy: Policy
    inflight: InFlight
    upstreams: UpstreamPool  # pooled keep-alive connections to the workers
    health: Health = field(default_factory=Health)
    retry_budget: RetryBudget = field(default_factory=RetryBudget)
    observers: tuple[Observer, ...] = ()
    drains: DrainHolder = field(default_factory=DrainHolder)
    admission: Admission | None = None  # API keys and rate limits; None: neither
    queue: RouterQueue | None = None  # waiting for a worker with room; None: never waits
    propagate_trace: bool = False  # tracing on: workers continue the router's span

    def __post_init__(self) -> None:
        # `_authorize`'s "Bearer <key>" per region, for the config it was read from.
        self._keys: dict[str, str | None] = {}
        self._keys_config: GlobalConfig | None = None

    @property
    def config(self) -> GlobalConfig:
        """The regions.yaml in force now (hot reload swaps it between requests)."""
        return self.configs.current

    async def inference(self, exchange: Exchange) -> Reply:
        """POST /v1/chat/completions, /v1/completions, /v1/embeddings.

        Refusals come back as error replies (never raised), with the caller's rate-limit
        headers once it was admitted."""
        received_s = time.monotonic()
        config = self.configs.current  # (`self.config`, without the property's call)
        router_config = config.router
        admission = self.admission
        request_id = request_id_of(exchange.headers)
        rate_headers: Mapping[str, str] | None = None
        try:
            # 401 before the body is read: an unknown client costs no body read.
            principal = (admission.authenticate(exchange.headers, config.auth)
                         if admission else None)
            if (exchange.content_length or 0) > router_config.max_body_bytes:
                limit = router_config.max_body_bytes
                raise ApiError(413, f"request body is too large (limit {limit} bytes)")
            body = exchange.body_if_here()
            if body is None:
                body = await exchange.read_body(router_config.client_timeouts.body_s)
            kind = _KIND_BY_PATH[exchange.path]
            parsed = parse_body(body, kind, router_config.max_json_depth)
            if admission is not None and principal is not None:  # else nothing to check
                rate_headers = await admission.admit(principal, parsed, config.auth)  # 403, 429
            origin = self._origin_region(exchange.headers)
            hints = _routing_hints(exchange.headers)
        except ApiError as exc:
            return _with_headers(api_error_reply(exc), rate_headers, request_id)
        except Exception as exc:
            log.exception("request %s (%s): internal error in the router before routing",
                          request_id, exchange.path)
            self._count_unrouted(exchange.path, received_s, request_id, exc)
            return _internal_error(request_id, rate_headers)
        record = RequestRecord(model=parsed.model, kind=kind, stream=parsed.stream,
                               origin_region=origin, received_s=received_s,
                               request_id=request_id)
        try:
            reply = await self._route_and_forward(config, exchange, body, parsed, record,
                                                  principal, hints, rate_headers)
        except (asyncio.CancelledError, ConnectionError):
            # The client went away: its handler was cancelled (the front, aiohttp), or
            # writing to it failed. Nothing else is a 499.
            record.status = 499
            raise
        except Exception as exc:
            record.status = 500  # the router's own fault, whatever the attempt was doing
            record.error = f"internal error: {type(exc).__name__}"
            log.exception("request %s (%s %s): internal error in the router", request_id,
                          exchange.path, parsed.model)
            if record.stream and record.served_by is not None:
                raise  # the stream had started: its server cuts the connection
            return _internal_error(request_id, rate_headers)
        else:
            record.status = reply.status
            return _with_headers(reply, rate_headers, request_id)
        finally:
            record.finished_s = time.monotonic()
            if admission is not None and principal is not None:
                admission.record_residency(principal, record)
            for observer in self.observers:
                observer.request_finished(record)

    async def _route_and_forward(
        self, config: GlobalConfig, exchange: Exchange, body: bytes, parsed: ParsedRequest,
        record: RequestRecord, principal: Principal | None,
        hints: tuple[str | None, str, float | None], rate_headers: Mapping[str, str] | None,
    ) -> Reply:
        router_config = config.router
        headers = upstream_headers(exchange.headers)
        headers["x-request-id"] = record.request_id  # the worker's logs name it too
        if self.propagate_trace:
            inject_current_trace(headers)  # the worker continues this router's span
        session_id, traffic_class, budget_ms = hints
        record.traffic_class = traffic_class
        allowed = None if principal is None else principal.allowed_regions  # data residency
        failover = _failover_for(router_config, exchange, parsed, body, record.kind)
        broken_stream: StreamBroken | None = None
        tried: set[str] = set()
        avoid_regions: set[str] = set()
        failure: UpstreamFailure | None = None
        self.retry_budget.request_arrived()
        free_retry = False
        # `__new__` called directly: `RouteRequest(...)` costs twice as much, as the type's
        # call turns the keywords into a dict for a named tuple's Python `__new__`.
        route = RouteRequest.__new__(
            RouteRequest,
            model=parsed.model,
            origin_region=record.origin_region,
            prompt_tokens=parsed.prompt_tokens,
            stream=parsed.stream,
            drained=self.drains.current,
            allowed_regions=allowed,
            session_id=session_id,
            prefix_key=parsed.prefix_key,
            prefix_tokens=PREFIX_TOKENS if parsed.prefix_key is not None else 0,
            traffic_class=traffic_class,
            ttft_budget_ms=budget_ms,
        )
        for attempt_number in range(router_config.max_attempts):
            if attempt_number > 0:
                if not free_retry and not self.retry_budget.try_spend():
                    log.warning("retry budget exhausted; not retrying %s", parsed.model)
                    break
                route = route._replace(exclude=frozenset(tried), drained=self.drains.current,
                                       avoid_regions=frozenset(avoid_regions))
            counted = False  # in the open-request counts already (the queue did it)
            try:
                decision = self.policy.pick(self.holder.current, route)
                queue = self.queue
                if attempt_number == 0 and queue is not None:
                    counted = True
                    if not queue.goes_now(parsed.model, decision):
                        decision, record.queued_s = await queue.turn(
                            decision, functools.partial(self._pick, route),
                            model=parsed.model, traffic_class=traffic_class,
                            arrived_s=record.received_s, budget_ms=budget_ms)
            except NoRoute as no_route:
                if failure is not None:
                    log.warning("no retry for %s: %s", parsed.model, no_route.reason)
                    break  # report the upstream failure, not "nothing left to try"
                record.error = no_route.reason
                return _no_route(no_route, configured=parsed.model in config.models)
            except QueueFull as full:
                record.error = str(full)
                return error_reply(503, f"no capacity: every worker is busy and {full}",
                                   code="queue_full", headers={"Retry-After": "1"})
            worker = decision.worker
            tried.add(worker.worker_id)
            now = time.monotonic()
            if record.routed_s is None:
                record.routed_s = now
            continuing = broken_stream is not None
            attempt = Attempt(worker_id=worker.worker_id, region=worker.region,
                              predicted_ttft_ms=decision.predicted_ttft_ms,
                              reason=("continuation" if continuing else
                                      decision.reason if not record.attempts else "retry"),
                              started_s=now, streamed=parsed.stream)
            record.attempts.append(attempt)
            reply_headers = {
                REGION_HEADER: worker.region,
                WORKER_HEADER: worker.worker_id,
                ROUTE_HEADER: attempt.reason,
                REQUEST_ID_HEADER: record.request_id,
                "server-timing": _server_timing(record, attempt),
            }
            if rate_headers:
                reply_headers.update(rate_headers)
            if decision.budget_met is not None:
                reply_headers[BUDGET_HEADER] = "met" if decision.budget_met else "missed"
            self._authorize(headers, config, worker.region)
            if not counted:
                self.inflight.started(worker.worker_id)
            self.health.dispatched(attempt)
            if session_id or parsed.prefix_key is not None:
                # Remembered as it is sent, not when it ends: the worker holds the prompt
                # once prefilled, and requests sharing the prefix that arrive meanwhile
                # should find it there (twin: prefix hits +1.8 points over six traces, +4.5
                # on the quick one). A failed attempt's retry is remembered in its place.
                self.policy.context.affinity.remember(
                    session_id, parsed.prefix_key, worker.worker_id,
                    prompt_tokens=parsed.prompt_tokens, prefix_tokens=route.prefix_tokens)
            try:
                target = target_of(worker.endpoint)
                if failover is not None and continuing:
                    return await self._continue(exchange, failover, target, headers, attempt,
                                                record)
                payload = target.request(exchange.path, headers, body)
                if parsed.stream:
                    reply = await forward_stream(
                        exchange, self.upstreams, target, payload, router_config.timeouts,
                        reply_headers, attempt, router_config.client_timeouts.stall_s,
                        None if failover is None else failover.transcript)
                    if attempt.error is not None:
                        record.error = attempt.error
                        log.warning("request %s: stream from %s (%s) ended early: %s",
                                    record.request_id, worker.worker_id, worker.region,
                                    attempt.error)
                else:
                    reply = await forward_unary(self.upstreams, target, payload,
                                                router_config.timeouts, reply_headers, attempt)
                return reply
            except StreamBroken as broken:
                _note_failure(attempt, broken)
                log.warning("request %s: stream from %s (%s) broke off: %s", record.request_id,
                            worker.worker_id, worker.region, broken.detail)
                assert failover is not None  # (only a kept transcript raises it)
                if await _stream_ended(exchange, failover, broken, record):
                    return Reply(200, {}, streamed=True)
                broken_stream = failure = broken
                free_retry = True  # failover: the budget guards against amplification
            except UpstreamFailure as failed:
                log.warning("request %s: attempt on %s (%s) failed before first byte: %s",
                            record.request_id, worker.worker_id, worker.region, failed.detail)
                _note_failure(attempt, failed)
                # A retry costs no budget when the failed attempt did no work anywhere: a
                # refused connection, or a wait abandoned on a stalled worker (ejected, so
                # its requests move once; the budget guards against amplification, and
                # this is failover).
                free_retry = (failed.kind is Failure.CONNECT or attempt.abandoned is not None
                              or continuing)
                if failed.kind in _PATH_FAILURES:
                    # The path to the region may be down (refused, or a blackhole that
                    # only times out): the retry prefers another region. A reset is
                    # usually one stale pooled connection, not the region.
                    avoid_regions.add(worker.region)
                failure = failed
            finally:
                self.inflight.finished(worker.worker_id)
                if self.queue is not None:
                    self.queue.capacity_freed()
                attempt.finished_s = time.monotonic()
                self.health.attempt_finished(attempt)
                for observer in self.observers:
                    observer.attempt_finished(attempt)
        assert failure is not None
        record.error = failure.detail
        if broken_stream is not None:  # the client has part of the answer: end it
            record.failover = "failed"
            await end_broken_stream(exchange, None if failover is None else failover.transcript,
                                    broken_stream)
            return Reply(200, {}, streamed=True)
        status = failure.status if failure.status in (502, 503, 504) else 502
        return error_reply(
            status,
            f"the request failed on {len(tried)} worker(s); last error: {failure.message}",
            code="upstream_failed",
            headers={"Retry-After": "1"},
        )

    async def _continue(self, exchange: Exchange, failover: Failover, target: Target,
                        headers: dict[str, str], attempt: Attempt, record: RequestRecord
                        ) -> Reply:
        """Ask `target` for the rest of a broken stream and pass it on (raises
        UpstreamFailure when it does not start, StreamBroken when it breaks off too)."""
        router_config = self.config.router
        payload = target.request(exchange.path, headers, failover.next_body())
        record.continuations += 1
        with continuation_span(attempt.worker_id, attempt.region):
            await continue_stream(exchange, self.upstreams, target, payload,
                                  router_config.timeouts, attempt,
                                  router_config.client_timeouts.stall_s, failover.transcript,
                                  Rewriter(failover.transcript),
                                  functools.partial(_continuation_timing, record))
        record.failover = "continued"
        log.info("request %s: stream continued on %s (%s)", record.request_id,
                 attempt.worker_id, attempt.region)
        return Reply(200, {}, streamed=True)

    def _count_unrouted(self, path: str, received_s: float, request_id: str,
                        exc: Exception) -> None:
        """A router fault before the request was parsed: observers count it as a 500."""
        record = RequestRecord(model="", kind=_KIND_BY_PATH.get(path, "chat"), stream=False,
                               origin_region=self.region, received_s=received_s,
                               request_id=request_id, status=500,
                               error=f"internal error: {type(exc).__name__}")
        record.finished_s = time.monotonic()
        for observer in self.observers:
            observer.request_finished(record)

    def _authorize(self, headers: dict[str, str], config: GlobalConfig, region: str) -> None:
        """`Authorization: Bearer <key>` in `headers` for `region`'s workers, or none (the
        client's own never goes upstream). The key is read once per region and config."""
        if config is not self._keys_config:
            self._keys_config = config
            self._keys.clear()
        value = self._keys.get(region, _UNREAD)
        if value is _UNREAD:
            key = upstream_key(config, region)
            value = self._keys[region] = None if key is None else f"Bearer {key}"
        if value is None:
            headers.pop("authorization", None)
        else:
            headers["authorization"] = value

    def _pick(self, route: RouteRequest) -> Decision:
        """Route on the fleet view of this moment (a waiting request is routed again)."""
        return self.policy.pick(self.holder.current, route)

    def _origin_region(self, headers: Mapping[str, str]) -> str | None:
        named = headers.get(CLIENT_REGION_HEADER)
        if named is None:
            return self.region
        if named not in self.config.regions:
            raise ApiError(400, f"{CLIENT_REGION_HEADER}: no region named {named!r}")
        return named

    async def models(self, request: web.Request) -> web.Response:
        """GET /v1/models: the union of models served by live workers in every region
        (those the caller's API key may use, when keys are configured)."""
        created = int(time.time())
        admission = self.admission
        principal = (admission.authenticate(request.headers, self.config.auth)
                     if admission is not None else None)
        data = [
            {"id": model, "object": "model", "created": created, "owned_by": "globalpool"}
            for model in self.holder.current.models(time.monotonic())
            if admission is None or admission.may_use_model(principal, model)
        ]
        return web.json_response({"object": "list", "data": data})

    async def health_check(self, request: web.Request) -> web.Response:
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


_PATH_FAILURES = frozenset({Failure.CONNECT, Failure.TIMEOUT})


def _continuation_timing(record: RequestRecord) -> str:
    """The `server-timing` trailer of a continued stream: how long its client waited
    between the first break and the continuation's first byte, and how many there were."""
    broke_s = next((a.finished_s for a in record.attempts
                    if a.failure is not None and a.first_byte_s is not None), None)
    served = record.attempts[-1]
    wait_ms = 0.0
    if broke_s is not None and served.first_byte_s is not None:
        wait_ms = (served.first_byte_s - broke_s) * 1000
    return f'continuation;dur={wait_ms:.3f};desc="{record.continuations}"'


def _note_failure(attempt: Attempt, failed: UpstreamFailure) -> None:
    attempt.error = failed.detail
    attempt.failure = failed.kind
    attempt.status = failed.status
    attempt.retry_after_s = failed.retry_after_s


def _failover_for(config: RouterConfig, exchange: Exchange, parsed: ParsedRequest,
                  body: bytes, kind: str) -> Failover | None:
    """The failover state of a stream that may be continued elsewhere, else None (not a
    stream, switched off for the model or by the client)."""
    if not parsed.stream or kind == "embeddings":
        return None
    settings = config.stream_failover
    if (not settings.enabled or parsed.model in settings.disabled_models
            or exchange.headers.get(FAILOVER_HEADER, "").lower() == "off"):
        return None
    return Failover(body, kind, event_limit(parsed.completion_tokens, parsed.choices))


async def _stream_ended(exchange: Exchange, failover: Failover, broken: StreamBroken,
                        record: RequestRecord) -> bool:
    """After a stream broke off: end it here if it cannot or need not be continued (True),
    else False (the caller continues it on another worker)."""
    if failover.finished():
        record.failover = "finished"  # nothing left to generate: only its end was missing
        await exchange.end_stream(failover.closing_events())
        return True
    reason = failover.refusal()
    if reason is None:
        return False
    record.failover, record.failover_reason = "not_continued", reason
    record.error = broken.detail
    log.warning("request %s: stream not continued elsewhere: %s", record.request_id, reason)
    await end_broken_stream(exchange, failover.transcript, broken)
    return True


def _no_route(exc: NoRoute, *, configured: bool) -> Reply:
    """The answer when routing found no worker: 404 `model_not_found` for a model that no
    worker serves or served lately and regions.yaml does not list (`configured`); else
    503 with Retry-After and the cause's own code (see NoRoute)."""
    if not exc.model_known and not configured:
        return error_reply(404, f"The model does not exist or is not served: {exc.reason}",
                              code="model_not_found", param="model")
    return error_reply(503, exc.reason, code=exc.code, headers={"Retry-After": "1"})


def _server_timing(record: RequestRecord, attempt: Attempt) -> str:
    """`server-timing` before the answer starts: router time so far, by phase, in ms.

    `route` is arrival -> first routing decision (body read, validation, policy), less
    `queue`, the time it waited at the router for a worker with room;
    `retry` is time spent on earlier failed attempts. The upstream's own time shows in
    the client's TTFB minus these.
    """
    routed = record.routed_s if record.routed_s is not None else attempt.started_s
    route = f"route;dur={(routed - record.received_s - record.queued_s) * 1000:.3f}"
    if not record.queued_s and len(record.attempts) < 2:
        return route  # the usual request: routed at once, first attempt
    parts = [route]
    if record.queued_s:
        parts.append(f"queue;dur={record.queued_s * 1000:.3f}")
    if len(record.attempts) > 1:
        parts.append(f"retry;dur={(attempt.started_s - routed) * 1000:.3f}")
    return ", ".join(parts)


def _internal_error(request_id: str, headers: Mapping[str, str] | None) -> Reply:
    return _with_headers(
        error_reply(500, f"internal error in the router (request {request_id}; the router's "
                    "log has the details)", code="internal_error"), headers, request_id)


def _with_headers(reply: Reply, headers: Mapping[str, str] | None, request_id: str) -> Reply:
    """`reply` with the caller's rate-limit `headers` and the request id (every answer
    carries it; a forwarded one has it already, set with the others)."""
    if headers:
        reply.headers = {**headers, **reply.headers}
    if REQUEST_ID_HEADER not in reply.headers:
        reply.headers[REQUEST_ID_HEADER] = request_id
    return reply


def _routing_hints(headers: Mapping[str, str]) -> tuple[str | None, str, float | None]:
    """Session id, traffic class and TTFT budget (ms) from the request's headers."""
    session_id = headers.get(SESSION_HEADER) or None
    if session_id is not None and len(session_id) > 256:
        raise ApiError(400, f"{SESSION_HEADER}: at most 256 characters")
    traffic_class = headers.get(CLASS_HEADER, "interactive")
    if traffic_class not in TRAFFIC_CLASSES:
        raise ApiError(400, f"{CLASS_HEADER}: one of {', '.join(TRAFFIC_CLASSES)}")
    raw_budget = headers.get(TTFT_BUDGET_HEADER)
    budget_ms: float | None = None
    if raw_budget is not None:
        try:
            budget_ms = float(raw_budget)
        except ValueError:
            budget_ms = -1.0
        if not 0 < budget_ms < 86_400_000:
            raise ApiError(400, f"{TTFT_BUDGET_HEADER}: a positive number of milliseconds")
    return session_id, traffic_class, budget_ms
