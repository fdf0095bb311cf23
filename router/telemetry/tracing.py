"""OpenTelemetry: one span per proxied request, continued by the worker (W3C traceparent).

- `traced` opens a SERVER span around each inference request, as a child of the
  client's `traceparent` if it sent one, and makes it the current span.
- `inject_current_trace` (router.proxy.trace_context, called by the proxy when it builds
  the upstream headers) puts that span's context in `traceparent`, so the worker's spans
  hang under the router's.
- `SpanAnnotator`, an observer, writes the outcome onto the current span: chosen region
  and worker, predicted and measured TTFT, the router's own time (queue, earlier failed
  attempts), the client's TTFT budget and whether it was met, attempts and retries; and
  each attempt as a child span, made when it ends (with the times it ran): the worker and
  why, the TTFT predicted by its parts and the measured TTFB (the same span: request
  sent -> first byte), its chunk gaps.

Export is configured only by the standard `OTEL_*` variables: with
`OTEL_EXPORTER_OTLP_ENDPOINT` (or `..._TRACES_ENDPOINT`, or `OTEL_TRACES_EXPORTER=otlp`)
set, spans go over OTLP/HTTP (package `opentelemetry-exporter-otlp-proto-http`, optional:
without it tracing stays off with a warning). Unset, there is no tracing and no cost.
Tests pass their own TracerProvider with an in-memory exporter.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind, Status, StatusCode

from router.core.outcome import Attempt, Prediction, RequestRecord
from router.proxy import trace_context
from router.proxy.exchange import Exchange, InferenceHandler, Reply

log = logging.getLogger("globalpool.telemetry")

INSTRUMENTATION = "globalpool.router"


def tracer_provider_from_env(environ: Mapping[str, str] | None = None) -> TracerProvider | None:
    """A provider exporting over OTLP/HTTP when the OTEL_* variables ask for it, else None."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    exporter_name = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT")
    if exporter_name == "none" or (not endpoint and exporter_name != "otlp"):
        return None
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        log.warning("OTEL_* asks for trace export but opentelemetry-exporter-otlp-proto-http "
                    "is not installed: tracing is off (pip install it to export traces)")
        return None
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create(
        {"service.name": env.get("OTEL_SERVICE_NAME") or "globalpool-router"}))
    # The exporter reads OTEL_EXPORTER_OTLP_* (endpoint, headers, timeout) itself. The
    # batch processor exports from its own thread, off the event loop.
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    log.info("exporting traces over OTLP/HTTP to %s", endpoint or "the default endpoint")
    return provider


def traced(provider: trace.TracerProvider, handler: InferenceHandler) -> InferenceHandler:
    """`handler` (the proxy's inference), each request run inside its own SERVER span."""
    tracer = provider.get_tracer(INSTRUMENTATION)
    trace_context.set_tracer(tracer)

    async def trace_request(exchange: Exchange) -> Reply:
        parent = trace_context.extract(exchange.headers)
        with tracer.start_as_current_span(
            f"POST {exchange.path}", context=parent, kind=SpanKind.SERVER,
            record_exception=False, set_status_on_exception=False,
        ) as span:
            span.set_attribute("http.request.method", "POST")
            span.set_attribute("url.path", exchange.path)
            try:
                reply = await handler(exchange)
            except (asyncio.CancelledError, ConnectionError):
                span.set_attribute("http.response.status_code", 499)  # the client left
                raise
            except Exception as exc:  # the router's fault, mid-stream (else a 500 reply)
                span.set_attribute("http.response.status_code", 500)
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR))
                raise
            span.set_attribute("http.response.status_code", reply.status)
            if reply.status >= 500:
                span.set_status(Status(StatusCode.ERROR))
            return reply

    return trace_request


Attributes = dict[str, str | float | int | bool]


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


def _prediction_attributes(attributes: Attributes, prediction: Prediction) -> None:
    """The predicted TTFT's parts, `globalpool.prediction.<part>` (ms)."""
    for part, value_ms in zip(Prediction._fields, prediction, strict=True):
        attributes[f"globalpool.prediction.{part}"] = round(value_ms, 3)


def attempt_attributes(attempt: Attempt) -> Attributes:
    """What an attempt's span says: where it went and why, its predicted TTFT (and the
    parts, when the policy gave them), the measured TTFB, how it ended, its chunk gaps."""
    attributes: Attributes = {
        "globalpool.worker": attempt.worker_id,
        "globalpool.region": attempt.region,
        "globalpool.reason": attempt.reason,
        "globalpool.stream": attempt.streamed,
        "globalpool.predicted_ttft_ms": round(attempt.predicted_ttft_ms, 3),
    }
    if attempt.prediction is not None:
        _prediction_attributes(attributes, attempt.prediction)
    ttfb_s = attempt.ttfb_s
    if ttfb_s is not None:
        attributes["globalpool.ttfb_ms"] = _ms(ttfb_s)
        if attempt.predicted_ttft_ms > 0.0 and attempt.streamed and attempt.status == 200:
            attributes["globalpool.ttft_prediction_ratio"] = round(
                ttfb_s * 1000.0 / attempt.predicted_ttft_ms, 4)
    if attempt.failure is not None:
        attributes["globalpool.failure"] = attempt.failure.value
    if attempt.status is not None:
        attributes["http.response.status_code"] = attempt.status
    mean_itl_s = attempt.mean_itl_s
    if mean_itl_s is not None:
        attributes["globalpool.chunk_gaps"] = attempt.stream_gaps
        attributes["globalpool.itl_mean_ms"] = _ms(mean_itl_s)
    return attributes


class SpanAnnotator:
    """Observer: the request's outcome as attributes of the current (request) span, and
    each attempt as a child span of it. Runs only when tracing is on."""

    def __init__(self, provider: trace.TracerProvider) -> None:
        self._tracer = provider.get_tracer(INSTRUMENTATION)

    def attempt_finished(self, attempt: Attempt) -> None:
        """The attempt's span, made now that it ended, dated when it ran (its monotonic
        times moved onto the wall clock the spans use)."""
        parent = trace.get_current_span()
        if not parent.is_recording():
            return
        wall_minus_monotonic_ns = time.time_ns() - time.monotonic_ns()
        finished_s = attempt.finished_s if attempt.finished_s is not None else time.monotonic()
        span = self._tracer.start_span(
            "globalpool.attempt", context=trace.set_span_in_context(parent),
            start_time=int(attempt.started_s * 1e9) + wall_minus_monotonic_ns,
            attributes=attempt_attributes(attempt))
        if attempt.failure is not None:
            span.set_status(Status(StatusCode.ERROR, attempt.failure.value))
        span.end(end_time=int(finished_s * 1e9) + wall_minus_monotonic_ns)

    def request_finished(self, record: RequestRecord) -> None:
        span = trace.get_current_span()
        if not span.is_recording():
            return
        span.set_attribute("globalpool.model", record.model)
        span.set_attribute("globalpool.kind", record.kind)
        span.set_attribute("globalpool.stream", record.stream)
        if record.origin_region is not None:
            span.set_attribute("globalpool.origin_region", record.origin_region)
        span.set_attribute("globalpool.attempts", len(record.attempts))
        span.set_attribute("globalpool.retries", max(0, len(record.attempts) - 1))
        span.set_attribute("globalpool.status", record.status)
        if record.request_id:
            span.set_attribute("globalpool.request_id", record.request_id)
        if record.error is not None:
            span.set_attribute("globalpool.error", record.error)
        if record.continuations:
            span.set_attribute("globalpool.continuations", record.continuations)
        if record.failover is not None:
            span.set_attribute("globalpool.failover", record.failover)
        _budget_attributes(span, record)
        chosen = record.first_streamed or (record.attempts[-1] if record.attempts else None)
        if chosen is None:
            return
        span.set_attribute("globalpool.region", chosen.region)
        span.set_attribute("globalpool.worker", chosen.worker_id)
        span.set_attribute("globalpool.predicted_ttft_ms", round(chosen.predicted_ttft_ms, 3))
        _router_time_attributes(span, record, chosen)
        if chosen.first_byte_s is not None:
            measured_ms = (chosen.first_byte_s - record.received_s) * 1000.0
            # For a non-streaming request the first byte is the whole answer.
            name = "globalpool.ttft_ms" if record.stream else "globalpool.time_to_answer_ms"
            span.set_attribute(name, round(measured_ms, 3))


def _budget_attributes(span: trace.Span, record: RequestRecord) -> None:
    """The client's TTFT budget and, where it can be told (RequestRecord.ttft_budget_met),
    whether it was met."""
    if record.ttft_budget_ms is None:
        return
    span.set_attribute("globalpool.ttft_budget_ms", record.ttft_budget_ms)
    met = record.ttft_budget_met
    if met is not None:
        span.set_attribute("globalpool.ttft_budget_met", met)


def _router_time_attributes(span: trace.Span, record: RequestRecord, chosen: Attempt) -> None:
    """The router's own parts of the request's time before `chosen` was sent, in ms (as
    `server-timing` names them): routing, the wait in its queue, earlier failed attempts."""
    routed_s = record.routed_s if record.routed_s is not None else chosen.started_s
    span.set_attribute("globalpool.route_ms", _ms(routed_s - record.received_s - record.queued_s))
    span.set_attribute("globalpool.queued_ms", _ms(record.queued_s))
    span.set_attribute("globalpool.retry_ms", _ms(chosen.started_s - routed_s))
