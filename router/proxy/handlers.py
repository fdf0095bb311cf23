"""The OpenAI-compatible endpoints: validate, route, forward, retry before the first byte.

`Proxy.inference` admits a request; the routing-and-retry loop routes, counts and forwards
each attempt (`unary`, `stream`), retries a failed one elsewhere (`retries`), continues a
broken stream (`stream_failover`); `replies` makes what it answers."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

from router.admission.gate import Admission, Caller
from router.admission.queue import QueueFull, RouterQueue
from router.auth.keys import Principal
from router.config import GlobalConfig, RouterConfig
from router.config_reload import ConfigHolder
from router.core.endpoints import KIND_BY_PATH
from router.core.errors import ApiError
from router.core.outcome import Attempt, Observer, RequestRecord
from router.core.parse import ParsedRequest, parse_body
from router.core.parse_form import FORM_KINDS, parse_form
from router.health import Health, RetryBudget
from router.policy import Decision, NoRoute, Policy, RouteRequest
from router.proxy.continuation import Failover
from router.proxy.exchange import Exchange, Reply, api_error_reply
from router.proxy.failures import StreamBroken, UpstreamFailure
from router.proxy.hedging import HEDGE_HEADER, Hedge, Hedges, Opened, hedge_wanted
from router.proxy.prompt_count import prompt_count
from router.proxy.replies import (
    internal_error,
    no_route_reply,
    queue_full_reply,
    reply_headers,
    with_headers,
)
from router.proxy.request_id import request_id_of
from router.proxy.responses import ResponsesApi
from router.proxy.retries import Retries, could_retry, gave_up, never, note_failure, pick_now
from router.proxy.routing_hints import origin_region, route_request, routing_hints
from router.proxy.stream import forward_stream, open_stream
from router.proxy.stream_failover import continue_broken_stream, failover_for, stream_ended
from router.proxy.targets import Target, target_of, worker_headers
from router.proxy.unary import forward_unary
from router.proxy.unserved import Unserved
from router.proxy.upstream.pool import UpstreamPool
from router.proxy.worker_auth import WorkerAuth
from router.registry.drains import DrainHolder
from router.registry.inflight import InFlight
from router.registry.snapshot import SnapshotHolder

log = logging.getLogger("globalpool.proxy")


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
    responses: ResponsesApi | None = None  # stored responses' holders; None: not followed
    hedges: Hedges = field(default_factory=Hedges, init=False)
    unserved: Unserved = field(default_factory=Unserved, init=False)
    _worker_auth: WorkerAuth = field(default_factory=WorkerAuth, init=False)

    @property
    def config(self) -> GlobalConfig:
        """The regions.yaml in force now (hot reload swaps it between requests)."""
        return self.configs.current

    async def inference(self, exchange: Exchange,
                        caller: Principal | Caller | None = Caller.FROM_HEADERS) -> Reply:
        """POST to an inference endpoint (router.core.endpoints: /v1/chat/completions, ...).

        Refusals come back as error replies (never raised), with the caller's rate-limit
        headers once it was admitted. `caller`: who sends it when the router itself does
        (a batch's line, for the key that created the batch); by default `Authorization`."""
        received_s = time.monotonic()
        config = self.configs.current  # (`self.config`, without the property's call)
        router_config = config.router
        admission = self.admission
        request_id = request_id_of(exchange.headers)
        rate_headers: Mapping[str, str] | None = None
        try:
            # 401 before the body is read: an unknown client costs no body read.
            principal = (caller if caller is not Caller.FROM_HEADERS
                         else admission.authenticate(exchange.headers, config.auth)
                         if admission else None)
            if (exchange.content_length or 0) > router_config.max_body_bytes:
                limit = router_config.max_body_bytes
                raise ApiError(413, f"request body is too large (limit {limit} bytes)")
            body = exchange.body_if_here()
            if body is None:
                body = await exchange.read_body(router_config.client_timeouts.body_s)
            kind = KIND_BY_PATH[exchange.path]
            parsed = (parse_body(body, kind, router_config.max_json_depth)
                      if kind not in FORM_KINDS else
                      parse_form(body, exchange.headers.get("content-type", ""), kind))
            if admission is not None and principal is not None:  # else nothing to check
                rate_headers = await admission.admit(principal, parsed, config.auth)  # 403, 429
            origin = origin_region(exchange.headers, self.region, self.config)
            hints = routing_hints(exchange.headers)
            pinned = (await self.responses.holder_of(parsed, principal)  # 404, 503
                      if parsed.previous_response_id is not None and self.responses
                      else None)
        except ApiError as exc:
            return with_headers(api_error_reply(exc), rate_headers, request_id)
        except Exception as exc:
            log.exception("request %s (%s): internal error in the router before routing",
                          request_id, exchange.path)
            self._request_finished(RequestRecord.unrouted(
                exchange.path, self.region, received_s, request_id, exc), None)
            return internal_error(request_id, rate_headers)
        record = RequestRecord(model=parsed.model, kind=kind, stream=parsed.stream,
                               origin_region=origin, received_s=received_s, request_id=request_id)
        stored = (self.responses.storing(parsed, principal)
                  if kind == "responses" and self.responses else None)
        if stored is not None:
            record.on_first_event = stored.first_event
        try:
            reply = await self._route_and_forward(config, exchange, body, parsed, record,
                                                  principal, hints, rate_headers, pinned)
            if stored is not None:
                await stored.finished(reply, record)  # before the client can ask elsewhere
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
            return internal_error(request_id, rate_headers)
        else:
            record.status = reply.status
            return with_headers(reply, rate_headers, request_id)
        finally:
            self._request_finished(record, principal)

    async def _route_and_forward(
        self, config: GlobalConfig, exchange: Exchange, body: bytes, parsed: ParsedRequest,
        record: RequestRecord, principal: Principal | None,
        hints: tuple[str | None, str, float | None], rate_headers: Mapping[str, str] | None,
        pinned: str | None = None,
    ) -> Reply:
        """The routing-and-retry loop: each attempt on a worker not tried yet (only on
        `pinned`, if given), at most `max_attempts`; a stream that broke off is continued
        on the next."""
        router_config = config.router
        headers = worker_headers(exchange.headers, record.request_id, self.propagate_trace)
        _, record.traffic_class, record.ttft_budget_ms = hints
        route = route_request(parsed, record, self.drains.current, principal, hints, pinned,
                              exchange.paced)
        route = self.unserved.kept_from(route, self.holder.current)
        failover = failover_for(router_config, exchange, parsed, body, record.kind)
        retries: Retries | None = None  # made when an attempt fails
        self.retry_budget.request_arrived()
        for tries_left in range(router_config.max_attempts - 1, -1, -1):
            if retries is not None:
                if not retries.free and not self.retry_budget.try_spend():
                    log.warning("retry budget exhausted; not retrying %s", parsed.model)
                    break
                route = retries.next_route(route, self.drains.current, self.holder.current)
            queue = self.queue if retries is None else None  # a first attempt may wait
            try:
                decision = self.policy.pick(self.holder.current, route)
                if queue is not None and not queue.goes_now(route.model, decision):
                    decision = await self._wait_turn(queue, decision, route, record, principal)
            except NoRoute as no_route:
                if retries is not None:
                    log.warning("no retry for %s: %s", parsed.model, no_route.reason)
                    break  # report the upstream failure, not "nothing left to try"
                record.error = no_route.reason
                return no_route_reply(no_route, configured=parsed.model in config.models)
            except QueueFull as full:
                record.error = str(full)
                return queue_full_reply(full)
            continuing = retries is not None and retries.broken_stream is not None
            attempt = self._dispatched(decision, record, route, headers, config,
                                       queue is not None, continuing)
            attempt.elsewhere = never if not tries_left else functools.partial(
                could_retry, self.policy, self.holder, route, record)
            try:
                if failover is not None and continuing:
                    return await continue_broken_stream(
                        exchange, self.upstreams, self.config.router, failover,
                        target_of(decision.worker.endpoint), headers, attempt, record)
                return await self._forward(router_config, exchange, decision, attempt, record,
                                           headers, body, failover, rate_headers, route)
            except StreamBroken as broken:
                attempt = broken.attempt or attempt  # (a hedge's, when it answered)
                note_failure(attempt, broken)
                log.warning("request %s: stream from %s (%s) broke off: %s", record.request_id,
                            attempt.worker_id, attempt.region, broken.detail)
                assert failover is not None  # (only a kept transcript raises it)
                if await stream_ended(exchange, failover, broken, record, functools.partial(
                        self._count_prompt, config, route, attempt.worker_id, headers)):
                    return Reply(200, {}, streamed=True)
                retries = retries or Retries()
                retries.broke(attempt, broken)
            except UpstreamFailure as failed:
                retries = retries or Retries()
                worker_id = retries.failed(failed.attempt or attempt, failed, record.request_id)
                self.unserved.note(failed, worker_id, route.model, self.holder.current)
            finally:
                for each in record.attempts:  # (a hedge's too)
                    if each.finished_s is None:
                        self._attempt_finished(each)
            if retries is not None and retries.hopeless(self.holder.current, route.model):
                break
        return await gave_up(exchange, failover, retries, record, self.holder.current)

    async def _wait_turn(self, queue: RouterQueue, decision: Decision, route: RouteRequest,
                         record: RequestRecord, principal: Principal | None) -> Decision:
        """Wait in the queue for a worker with room (counted in flight there), routed again
        when its turn comes (the tenants take turns)."""
        decision, record.queued_s = await queue.turn(
            decision, functools.partial(pick_now, self.policy, self.holder, route),
            model=route.model, traffic_class=route.traffic_class, arrived_s=record.received_s,
            budget_ms=route.ttft_budget_ms, tenant=principal.tenant if principal else "")
        return decision

    async def _count_prompt(self, config: GlobalConfig, route: RouteRequest, tried: str,
                            headers: dict[str, str], body: bytes) -> int | None:
        """`prompt_count` by a worker of the model other than `tried` (None: there is none)."""
        try:
            worker = pick_now(self.policy, self.holder,
                              route._replace(exclude=route.exclude | {tried})).worker
        except NoRoute:
            return None
        self._worker_auth.authorize(headers, config, worker.region)
        return await prompt_count(self.upstreams, target_of(worker.endpoint), headers, body)

    def _dispatched(self, decision: Decision, record: RequestRecord, route: RouteRequest,
                    headers: dict[str, str], config: GlobalConfig, counted: bool,
                    continuing: bool) -> Attempt:
        """A new attempt on `decision`'s worker, in the request's record and counted as
        sent: in flight (unless `counted`: the queue did it), by health, by cache
        affinity; `headers` get the key of the worker's region."""
        worker = decision.worker
        now = time.monotonic()
        if record.routed_s is None:
            record.routed_s = now
        attempt = Attempt(worker_id=worker.worker_id, region=worker.region,
                          predicted_ttft_ms=decision.predicted_ttft_ms,
                          prediction=decision.prediction,
                          reason=("continuation" if continuing else
                                  decision.reason if not record.attempts else "retry"),
                          started_s=now, streamed=route.stream,
                          batch=route.traffic_class == "batch")
        record.attempts.append(attempt)
        if attempt.batch:  # (what it holds there is not the interactive load)
            self.policy.context.batch_room.started(worker.worker_id)
        self._worker_auth.authorize(headers, config, worker.region)
        if not counted:
            self.inflight.started(worker.worker_id)
        tokens = route.completion_tokens
        self.inflight.commit(attempt, tokens or 0, route.prompt_tokens - decision.cached_tokens,
                             now)
        self.health.dispatched(attempt)
        # Remembered as it is sent, not when it ends: the worker holds the prompt once
        # prefilled, and requests sharing the prefix that arrive meanwhile should find it
        # there (twin: prefix hits +1.8 points over six traces, +4.5 on the quick one). A
        # failed attempt's retry is remembered in its place.
        self.policy.context.affinity.sent(
            worker.worker_id, worker.cache_tokens, session_id=route.session_id,
            prefix_keys=route.prefix_keys, prompt_tokens=route.prompt_tokens,
            cached_tokens=decision.cached_tokens, completion_tokens=tokens)
        return attempt

    def _forward(self, config: RouterConfig, exchange: Exchange, decision: Decision,
                 attempt: Attempt, record: RequestRecord, headers: dict[str, str], body: bytes,
                 failover: Failover | None, rate_headers: Mapping[str, str] | None,
                 route: RouteRequest) -> Coroutine[Any, Any, Reply]:
        """Send `attempt` to its worker and pass the answer on (awaited by the caller: one
        coroutine less): a stream as it arrives (hedged if it may be), else the whole
        answer."""
        target = target_of(decision.worker.endpoint)
        payload = target.request(exchange.path, headers, body)
        if not attempt.streamed:
            return forward_unary(self.upstreams, target, payload, config.timeouts,
                                 reply_headers(record, attempt, decision, rate_headers), attempt)
        if ((config.hedging.classes or HEDGE_HEADER in exchange.headers)
                and route.only_worker is None and len(record.attempts) == 1
                and hedge_wanted(config.hedging, exchange.headers, route.traffic_class)):
            return self._hedged_stream(config, exchange, decision, attempt, record, headers,
                                       body, failover, rate_headers, route, payload)
        return self._forward_stream(config, exchange, target, payload,
                                    reply_headers(record, attempt, decision, rate_headers),
                                    attempt, record, failover)

    async def _hedged_stream(self, config: RouterConfig, exchange: Exchange,
                             decision: Decision, attempt: Attempt, record: RequestRecord,
                             headers: dict[str, str], body: bytes, failover: Failover | None,
                             rate_headers: Mapping[str, str] | None, route: RouteRequest,
                             payload: bytes) -> Reply:
        """A stream that may be hedged (router.proxy.hedging): sent again elsewhere if its
        first event is late, then passed on from whichever copy opened first."""
        hedge = self.hedges.prepare(config.hedging, decision, attempt, route)
        self.hedges.warm(hedge, self.upstreams, self.policy, self.holder.current, self.inflight)
        winner, opened = await self.hedges.first_to_start(
            open_stream(self.upstreams, target_of(decision.worker.endpoint), payload,
                        config.timeouts, attempt), hedge,
            functools.partial(self._send_hedge, config, exchange.path, record, headers, body,
                              hedge), self._lost, record)
        won = hedge.decision_of(winner)
        try:
            return await self._forward_stream(
                config, exchange, target_of(won.worker.endpoint), b"",
                reply_headers(record, winner, won, rate_headers), winner, record, failover,
                opened)
        except UpstreamFailure as failed:
            failed.attempt = winner
            raise

    def _send_hedge(self, config: RouterConfig, path: str, record: RequestRecord,
                    headers: dict[str, str], body: bytes, hedge: Hedge
                    ) -> tuple[Attempt, Coroutine[Any, Any, Opened]] | None:
        """The hedge's attempt on the next-best worker, sent (None: no room, or no budget)."""
        try:
            decision = self.policy.pick(self.holder.current, hedge.route)
        except NoRoute:
            return None
        if not hedge.spend():
            return None
        attempt = self._dispatched(decision, record, hedge.route, headers, self.config,
                                   False, False)
        hedge.sent(attempt, decision)
        target = target_of(decision.worker.endpoint)
        return attempt, open_stream(self.upstreams, target, target.request(path, headers, body),
                                    config.timeouts, attempt)

    def _lost(self, attempt: Attempt, failure: UpstreamFailure | None) -> None:
        """A copy of a hedged stream that did not answer: outrun by the other, or failed."""
        attempt.outrun = failure is None
        if failure is not None:
            note_failure(attempt, failure)
        self._attempt_finished(attempt)

    async def _forward_stream(self, config: RouterConfig, exchange: Exchange, target: Target,
                              payload: bytes, answer_headers: dict[str, str], attempt: Attempt,
                              record: RequestRecord, failover: Failover | None,
                              opened: Opened | None = None) -> Reply:
        """A stream passed on as it arrives (`opened` already: a hedged one), kept in
        `failover`'s transcript if any; an early end (an error event) is the request's."""
        reply = await forward_stream(
            exchange, self.upstreams, target, payload, config.timeouts, answer_headers,
            attempt, config.client_timeouts.stall_s,
            None if failover is None else failover.transcript, record.on_first_event, opened)
        if attempt.error is not None:
            record.error = attempt.error
            log.warning("request %s: stream from %s (%s) ended early: %s",
                        record.request_id, attempt.worker_id, attempt.region, attempt.error)
        return reply

    def _attempt_finished(self, attempt: Attempt) -> None:
        """However `attempt` ended: out of the in-flight counts, its room offered to a
        waiting request, and its outcome to health and the observers."""
        self.inflight.finished(attempt.worker_id)
        attempt.end_prefill()  # (when it ended before its first byte)
        if attempt.batch:
            self.policy.context.batch_room.finished(attempt.worker_id)
        if attempt.committed_tokens:
            self.inflight.release(attempt.worker_id, attempt.committed_tokens, attempt.started_s)
        if self.queue is not None:
            self.queue.capacity_freed()
        attempt.finished_s = time.monotonic()
        self.health.attempt_finished(attempt)
        if attempt.streamed:  # (only streams' first bytes are first tokens)
            self.hedges.delay.attempt_finished(attempt)
        for observer in self.observers:
            observer.attempt_finished(attempt)

    def _request_finished(self, record: RequestRecord, principal: Principal | None) -> None:
        """However the request ended: its residency to admission, its record to observers."""
        record.finished_s = time.monotonic()
        admission = self.admission
        if admission is not None and principal is not None:
            admission.record_residency(principal, record)
        for observer in self.observers:
            observer.request_finished(record)
