"""An attempt's span: its predicted TTFT by its parts, its measured TTFB and how it ran
(the real OpenTelemetry SDK, an in-memory exporter)."""

from __future__ import annotations

import time

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from router.core.outcome import Attempt, Failure, Prediction
from router.telemetry.tracing import SpanAnnotator, attempt_attributes


def test_an_attempts_span_has_its_predicted_parts_and_its_measured_ttfb() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    prediction = Prediction(rtt_ms=80.0, penalty_ms=5.0, queue_ms=12.5, prefill_ms=30.0,
                            first_step_ms=7.5)
    now = time.monotonic()
    attempt = Attempt(worker_id="b", region="eu-west", predicted_ttft_ms=prediction.total_ms,
                      reason="spillover", started_s=now - 0.5, first_byte_s=now - 0.35,
                      finished_s=now - 0.1, status=200, streamed=True, prediction=prediction,
                      stream_gaps=5, stream_ended_s=now - 0.1)
    failed = Attempt(worker_id="c", region="eu-west", predicted_ttft_ms=0.0, reason="retry",
                     started_s=now - 0.1, finished_s=now, failure=Failure.CONNECT)
    annotator = SpanAnnotator(provider)
    with provider.get_tracer("test").start_as_current_span("request") as request:
        annotator.attempt_finished(attempt)
        annotator.attempt_finished(failed)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"request", "globalpool.attempt"}
    first, second = (s for s in exporter.get_finished_spans() if s.name == "globalpool.attempt")
    attributes = dict(first.attributes or {})
    assert attributes["globalpool.predicted_ttft_ms"] == 135.0
    assert {part: attributes[f"globalpool.prediction.{part}"] for part in Prediction._fields
            } == prediction._asdict()
    assert attributes["globalpool.ttfb_ms"] == pytest.approx(150.0, abs=0.01)
    assert attributes["globalpool.ttft_prediction_ratio"] == pytest.approx(150 / 135, abs=1e-3)
    assert attributes["globalpool.chunk_gaps"] == 5
    assert attributes["globalpool.itl_mean_ms"] == pytest.approx(50.0, abs=0.01)
    assert first.parent is not None
    assert first.parent.span_id == request.get_span_context().span_id
    assert first.start_time is not None and first.end_time is not None
    assert first.end_time - first.start_time == pytest.approx(0.4e9, abs=1e6)  # as it ran
    # Nothing predicted and no first byte: no parts, no TTFB, no ratio; failed: an error.
    failed_attributes = dict(second.attributes or {})
    assert "globalpool.ttfb_ms" not in failed_attributes
    assert not any(name.startswith("globalpool.prediction.") for name in failed_attributes)
    assert failed_attributes["globalpool.failure"] == "connect"
    assert not second.status.is_ok
    assert "globalpool.ttft_prediction_ratio" not in attempt_attributes(failed)
