"""The request's trace as the proxy carries it: W3C context into the upstream headers, a
span around a continuation. `router.telemetry.tracing` opens the request's span and sets
the tracer here; without it (tracing off) both calls cost a check and do nothing."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, MutableMapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()  # stateless: W3C traceparent/tracestate
# The tracer of the request spans, for the spans inside a request's (one per process).
_tracer: trace.Tracer | None = None


def set_tracer(tracer: trace.Tracer) -> None:
    global _tracer
    _tracer = tracer


def extract(headers: Mapping[str, str]) -> Context:
    """The client's trace context from its `traceparent`/`tracestate` headers."""
    return _PROPAGATOR.extract(headers)


@contextlib.contextmanager
def continuation_span(worker_id: str, region: str) -> Iterator[None]:
    """A child span of the request's around a mid-stream continuation (nothing when the
    request is not traced)."""
    if _tracer is None or not trace.get_current_span().is_recording():
        yield
        return
    with _tracer.start_as_current_span(
        "globalpool.continuation",
        attributes={"globalpool.worker": worker_id, "globalpool.region": region},
    ):
        yield


def inject_current_trace(headers: MutableMapping[str, str]) -> None:
    """Put the current span's W3C context in `headers` (replacing the client's).

    Without a current span (tracing off) the headers stay as they are, so a client's own
    `traceparent` still reaches the worker.
    """
    if trace.get_current_span().get_span_context().is_valid:
        _PROPAGATOR.inject(headers)
