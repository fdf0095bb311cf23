"""What the client gets back beside a worker's answer: the headers that say where its
request went and where the time went (`server-timing`), and the router's own replies
when no worker answered."""

from __future__ import annotations

from collections.abc import Mapping

from router.admission.queue import QueueFull
from router.core.outcome import Attempt, RequestRecord
from router.policy import Decision, NoRoute
from router.proxy.exchange import Reply, error_reply
from router.proxy.failures import UpstreamFailure

REGION_HEADER = "x-globalpool-region"
WORKER_HEADER = "x-globalpool-worker"
ROUTE_HEADER = "x-globalpool-route"  # why this worker: local, spillover, affinity, batch...
# The TTFT the router predicted for the worker it chose (ms): a prediction, not an
# outcome. Whether a client's TTFT budget was met is known only at the first byte, after
# the headers: it is counted then (metrics, logs, traces), never claimed in a header.
PREDICTED_TTFT_HEADER = "x-globalpool-predicted-ttft-ms"
REQUEST_ID_HEADER = "x-request-id"  # the client's own (if sane), else the router's


def reply_headers(record: RequestRecord, attempt: Attempt, decision: Decision,
                  rate_headers: Mapping[str, str] | None) -> dict[str, str]:
    """The router's headers of an attempt's answer (the worker's are added to them): where
    it went and why, the request id, `server-timing`, the caller's rate limits and the
    TTFT predicted there."""
    headers = {
        REGION_HEADER: attempt.region,
        WORKER_HEADER: attempt.worker_id,
        ROUTE_HEADER: attempt.reason,
        REQUEST_ID_HEADER: record.request_id,
        "server-timing": server_timing(record, attempt),
    }
    if rate_headers:
        headers.update(rate_headers)
    predicted_ms = decision.predicted_ttft_ms
    if predicted_ms > 0.0:
        headers[PREDICTED_TTFT_HEADER] = f"{predicted_ms:.1f}"
    return headers


def server_timing(record: RequestRecord, attempt: Attempt) -> str:
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
    hedge_s = next((a.hedge_delay_s for a in record.attempts if a.hedge_delay_s is not None),
                   None)
    if hedge_s is not None:  # (hedged: the copy or the original answers)
        answered = "copy" if attempt.reason == "hedge" else "original"
        parts.append(f'hedge;dur={hedge_s * 1000:.3f};desc="{answered}"')
    elif len(record.attempts) > 1:
        parts.append(f"retry;dur={(attempt.started_s - routed) * 1000:.3f}")
    return ", ".join(parts)


def continuation_timing(record: RequestRecord) -> str:
    """The `server-timing` trailer of a continued stream: how long its client waited
    between the first break and the continuation's first byte, and how many there were."""
    broke_s = next((a.finished_s for a in record.attempts
                    if a.failure is not None and a.first_byte_s is not None), None)
    served = record.attempts[-1]
    wait_ms = 0.0
    if broke_s is not None and served.first_byte_s is not None:
        wait_ms = (served.first_byte_s - broke_s) * 1000
    return f'continuation;dur={wait_ms:.3f};desc="{record.continuations}"'


def with_headers(reply: Reply, headers: Mapping[str, str] | None, request_id: str) -> Reply:
    """`reply` with the caller's rate-limit `headers` and the request id (every answer
    carries it; a forwarded one has it already, set with the others)."""
    if headers:
        reply.headers = {**headers, **reply.headers}
    if REQUEST_ID_HEADER not in reply.headers:
        reply.headers[REQUEST_ID_HEADER] = request_id
    return reply


def internal_error(request_id: str, headers: Mapping[str, str] | None) -> Reply:
    return with_headers(
        error_reply(500, f"internal error in the router (request {request_id}; the router's "
                    "log has the details)", code="internal_error"), headers, request_id)


def no_route_reply(exc: NoRoute, *, configured: bool) -> Reply:
    """The answer when routing found no worker: 404 `model_not_found` for a model that no
    worker serves or served lately and regions.yaml does not list (`configured`); else
    503 with Retry-After and the cause's own code (see NoRoute)."""
    if not exc.model_known and not configured:
        return error_reply(404, f"The model does not exist or is not served: {exc.reason}",
                           code="model_not_found", param="model")
    return error_reply(503, exc.reason, code=exc.code, headers={"Retry-After": "1"})


def queue_full_reply(full: QueueFull) -> Reply:
    """The answer when every worker is busy and the router's queue is full too."""
    return error_reply(503, f"no capacity: every worker is busy and {full}",
                       code="queue_full", headers={"Retry-After": "1"})


def upstream_failed_reply(failure: UpstreamFailure, workers: int) -> Reply:
    """The answer when the request failed on each of the `workers` it was tried on before
    their first byte; `failure` is the last one."""
    status = failure.status if failure.status in (502, 503, 504) else 502
    return error_reply(
        status,
        f"the request failed on {workers} worker(s); last error: {failure.message}",
        code="upstream_failed",
        headers={"Retry-After": "1"},
    )
