"""OpenTelemetry: one span per proxied request, continued by the worker (W3C traceparent).

- `traced` opens a SERVER span around each inference request, as a child of the
  client's `traceparent` if it sent one, and makes it the current span.
- `inject_current_trace` (router.proxy.trace_context, called by the proxy when it builds
  the upstream headers) puts that span's context in `traceparent`, so the worker's spans
  hang under the router's.
- `SpanAnnotator`, an observer, writes the outcome onto the current span: chosen region
  and worker, predicted and measured TTFT, attempts and retries.

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
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind, Status, StatusCode

from router.core.outcome import Attempt, RequestRecord
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


class SpanAnnotator:
    """Observer: the request's outcome as attributes of the current (request) span."""

    def attempt_finished(self, attempt: Attempt) -> None:
        span = trace.get_current_span()
        if not span.is_recording():
            return
        attributes: dict[str, str | float | int] = {
            "globalpool.worker": attempt.worker_id,
            "globalpool.region": attempt.region,
            "globalpool.reason": attempt.reason,
            "globalpool.predicted_ttft_ms": round(attempt.predicted_ttft_ms, 3),
        }
        if attempt.ttfb_s is not None:
            attributes["globalpool.upstream_ttfb_ms"] = round(attempt.ttfb_s * 1000.0, 3)
        if attempt.failure is not None:
            attributes["globalpool.failure"] = attempt.failure.value
        if attempt.status is not None:
            attributes["http.response.status_code"] = attempt.status
        span.add_event("attempt", attributes)

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
        chosen = record.first_streamed or (record.attempts[-1] if record.attempts else None)
        if chosen is None:
            return
        span.set_attribute("globalpool.region", chosen.region)
        span.set_attribute("globalpool.worker", chosen.worker_id)
        span.set_attribute("globalpool.predicted_ttft_ms", round(chosen.predicted_ttft_ms, 3))
        if chosen.first_byte_s is not None:
            measured_ms = (chosen.first_byte_s - record.received_s) * 1000.0
            # For a non-streaming request the first byte is the whole answer.
            name = "globalpool.ttft_ms" if record.stream else "globalpool.time_to_answer_ms"
            span.set_attribute(name, round(measured_ms, 3))
