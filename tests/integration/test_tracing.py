"""OpenTelemetry: a span per request, exported, whose context the worker receives."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import aiohttp
import pytest
from aiohttp import web
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from lab.devstack.valkey import free_port
from router.app import HOLDER, RouterSettings, build_app
from router.telemetry.tracing import tracer_provider_from_env
from tests.integration.operators_fleet import CHAT, OpsFleet, chat, post, wait_for

pytestmark = pytest.mark.integration

CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"
STEP_MS = 20.0  # the simulator's decode step, where a test sets it
STREAM = {**CHAT, "stream": True, "max_tokens": 6}


class HeaderRecorder:
    """Wraps a simulator: a real loopback server that notes each request's traceparent."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.traceparents: list[str | None] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._forward)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"

    async def _forward(self, request: web.Request) -> web.Response:
        self.traceparents.append(request.headers.get("traceparent"))
        async with aiohttp.ClientSession() as session, session.post(
                f"{self.upstream}{request.path}", data=await request.read(),
                headers={"Content-Type": "application/json"}) as response:
            return web.Response(status=response.status, body=await response.read(),
                                content_type=response.content_type)

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()



async def test_a_span_per_request_and_its_context_reaches_the_worker(fleet: OpsFleet) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    await fleet.start({"a": "us-east"}, tracer_provider=provider)
    recorder = HeaderRecorder(fleet.sims["a"].url)
    await recorder.start()
    try:
        fleet.endpoints["a"] = recorder.url  # the heartbeat now advertises the recorder
        await fleet.publish("a")
        await wait_for(lambda: fleet.apps[0][HOLDER].current.workers["a"].endpoint
                       == recorder.url)
        status, region, _ = await chat(fleet.url, CHAT, {"traceparent": CLIENT_TRACEPARENT})
        assert (status, region) == (200, "us-east")
        status, _, _ = await chat(fleet.url, {**CHAT, "stream": True})
        assert status == 200
    finally:
        await recorder.stop()

    spans = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER]
    assert len(spans) == 2
    first, second = spans
    context = first.get_span_context()
    assert context is not None
    # A child of the client's span, in the client's trace ...
    assert f"{context.trace_id:032x}" == CLIENT_TRACE_ID
    assert first.parent is not None and f"{first.parent.span_id:016x}" == CLIENT_SPAN_ID
    # ... and the worker got the router span's context, not the client's.
    assert recorder.traceparents[0] == f"00-{CLIENT_TRACE_ID}-{context.span_id:016x}-01"
    second_context = second.get_span_context()
    assert second_context is not None
    received = recorder.traceparents[1] or ""
    assert received.startswith(
        f"00-{second_context.trace_id:032x}-{second_context.span_id:016x}-")  # flags: sampled
    assert second.parent is None  # no client trace: the router's span is the root

    attributes = dict(first.attributes or {})
    assert attributes["globalpool.region"] == "us-east"
    assert attributes["globalpool.worker"] == "a"
    assert attributes["globalpool.retries"] == 0 and attributes["globalpool.attempts"] == 1
    assert isinstance(attributes["globalpool.predicted_ttft_ms"], float)
    assert attributes["http.response.status_code"] == 200
    streamed = dict(second.attributes or {})
    assert float(streamed["globalpool.ttft_ms"]) > 0  # type: ignore[arg-type]
    # Each attempt is a child span of its request's, with the prediction it was sent on
    # and the TTFB measured over the same span.
    attempts = [s for s in exporter.get_finished_spans() if s.name == "globalpool.attempt"]
    assert len(attempts) == 2
    assert all(a.parent is not None for a in attempts)
    assert {a.parent.span_id for a in attempts if a.parent is not None} == {
        context.span_id, second_context.span_id}
    for attempt in attempts:
        attempt_attributes = dict(attempt.attributes or {})
        assert attempt_attributes["globalpool.worker"] == "a"
        assert float(attempt_attributes["globalpool.ttfb_ms"]) > 0  # type: ignore[arg-type]
        assert isinstance(attempt_attributes["globalpool.predicted_ttft_ms"], float)
        assert attempt.start_time is not None and attempt.end_time is not None
        assert first.start_time is not None and first.end_time is not None
        assert attempt.start_time <= attempt.end_time
    assert "globalpool.queued_ms" in attributes and "globalpool.retry_ms" in attributes


async def test_no_exporter_configured_means_no_tracing() -> None:
    assert tracer_provider_from_env({}) is None
    assert tracer_provider_from_env({"OTEL_TRACES_EXPORTER": "none",
                                     "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x"}) is None
    assert tracer_provider_from_env({"OTEL_SDK_DISABLED": "true",
                                     "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x"}) is None


async def test_otlp_export_from_the_standard_variables(
        fleet: OpsFleet, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http.trace_exporter",
                        reason="opentelemetry-exporter-otlp-proto-http is not installed")
    received: list[bytes] = []
    collector = web.Application()

    async def traces(request: web.Request) -> web.Response:
        received.append(await request.read())
        return web.Response(body=b"", content_type="application/x-protobuf")

    collector.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(collector)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "router-under-test")
    try:
        await fleet.start({"a": "us-east"})
        assert (await chat(fleet.url))[0] == 200
        # Stopping the app shuts the provider down, which flushes the batch to the collector.
        # The exporter posts from its own thread, so let the loop serve it meanwhile.
        await fleet.close()
        for _ in range(100):
            if received:
                break
            await asyncio.sleep(0.05)
    finally:
        await runner.cleanup()
    assert received and b"router-under-test" in received[0]
    assert b"globalpool.worker" in received[0]


def number(attributes: Mapping[str, object], name: str) -> float:
    """A span's numeric attribute (absent or not a number: the test fails)."""
    found = attributes[name]
    assert isinstance(found, int | float) and not isinstance(found, bool), (name, found)
    return float(found)


async def test_spans_carry_the_budget_its_outcome_and_the_stream_gaps(fleet: OpsFleet) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    await fleet.start({"a": "us-east"}, decode_step_ms=STEP_MS, tracer_provider=provider)
    for budget in ("3600000", "1"):
        status, _, _ = await post(fleet.url, STREAM, {"x-globalpool-ttft-budget-ms": budget})
        assert status == 200

    spans = exporter.get_finished_spans()
    requests = [s for s in spans if s.kind is SpanKind.SERVER]
    attempts = [s for s in spans if s.name == "globalpool.attempt"]
    assert len(requests) == 2 and len(attempts) == 2
    met, missed = (dict(s.attributes or {}) for s in requests)
    assert (met["globalpool.ttft_budget_ms"], met["globalpool.ttft_budget_met"]) == (
        3600000.0, True)
    assert (missed["globalpool.ttft_budget_ms"], missed["globalpool.ttft_budget_met"]) == (
        1.0, False)
    for request, attempt in zip(requests, attempts, strict=True):
        request_context = request.get_span_context()
        assert attempt.parent is not None and request_context is not None
        assert attempt.parent.span_id == request_context.span_id
        # Dated when it ran: inside its request's span (within 1 ms: the clocks' conversion).
        assert request.start_time is not None and request.end_time is not None
        assert attempt.start_time is not None and attempt.end_time is not None
        assert request.start_time - 1_000_000 <= attempt.start_time
        assert attempt.end_time <= request.end_time + 1_000_000
        attributes = dict(attempt.attributes or {})
        ttfb_ms = number(attributes, "globalpool.ttfb_ms")
        assert ttfb_ms >= STEP_MS * 0.9  # the first token's decode step
        ttft_ms = number(dict(request.attributes or {}), "globalpool.ttft_ms")
        assert ttft_ms >= ttfb_ms  # the client's TTFT holds the attempt's TTFB
        assert number(attributes, "globalpool.chunk_gaps") >= 4
        assert number(attributes, "globalpool.itl_mean_ms") >= STEP_MS * 0.5


def test_settings_accept_a_provider() -> None:
    assert "tracer_provider" in RouterSettings.__dataclass_fields__
    assert callable(build_app)
