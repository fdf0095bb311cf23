"""Prometheus metrics of one router replica, in a registry of its own (no globals).

Two kinds:
- per request and attempt (`RequestMetrics`, an observer, here): counters and histograms
  updated inline, a few dictionary lookups each;
- the state of the fleet and of the router (router.telemetry.fleet.FleetCollector): read
  only when Prometheus scrapes, from the snapshot, the drain flags, passive health and the
  config holder.

ITL as the router passes streams on (`globalpool_itl_seconds`): per stream, the reads
from the worker after the first event (each one gap between chunks: the router does not
parse events, so several tokens in one read are one gap, as its client sees them) and
the time from the first byte to the end, observed as that many gaps at their mean. The
count and the sum are exact (sum/count is the token-weighted mean ITL); the buckets place
each stream's gaps at its mean, so quantiles tell slow streams, not one stall inside a
fast stream (timing every chunk cost 5-15 % more instructions per streamed request:
README, "Performance"). The per-worker ITL the engines report in their heartbeats stays
`globalpool_worker_itl_seconds`.

Predictions against outcomes: `globalpool_ttft_prediction_ratio` is measured over
predicted TTFT per streamed attempt (the same span: request sent to the worker -> its
first byte), and `globalpool_ttft_budget_requests_total` counts the streams whose
client-side TTFT met or missed the client's `x-globalpool-ttft-budget-ms`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from router.core.outcome import Attempt, RequestRecord
from router.telemetry.series import LabelledCounter, LabelledHistogram
from router.telemetry.window import NO_REGION

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                     1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0, 120.0)
# Measured over predicted TTFT: dense around 1 (a prediction within 5-10 %), wide enough
# for a prediction off by 4x either way, and +Inf past 10x.
RATIO_BUCKETS = (0.1, 0.25, 0.5, 0.67, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0, 1.05, 1.1, 1.15,
                 1.2, 1.25, 1.33, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 7.5, 10.0)
# Gaps between a stream's chunks: dense where decode steps are (5-50 ms), a tail for stalls.
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.02, 0.025, 0.03, 0.04,
                 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0)
ROUTE_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
OTHER_MODEL = "(other)"  # unrouted requests for models nobody serves: bounded label values
# Distinct model label values a router gives routed requests (the models of regions.yaml
# and LoRA adapters that verified workers serve); past it, new names count as OTHER_MODEL:
# what heartbeats advertise must not decide the metrics' cardinality.
MAX_MODEL_LABELS = 256
DEFAULT_CLASS = "interactive"
# What operators compare latencies by: the serving region, the model, the traffic class
# (bounded: router.proxy.routing_hints.TRAFFIC_CLASSES).
BY_CLASS = ("region", "model", "class")


# HTTP statuses as label values, made once: a new string per request would be hashed and
# compared character by character at every count.
_STATUS_LABELS = {status: str(status) for status in range(100, 600)}


class RequestMetrics:
    """Observer: request, attempt and latency metrics. Cheap enough to run per request."""

    def __init__(self, registry: CollectorRegistry, known_models: Callable[[], list[str]]
                 ) -> None:
        self._known_models = known_models
        self._model_labels: set[str] = set()  # routed requests' model labels so far
        self.requests = LabelledCounter(
            "globalpool_requests", "Client requests by serving region, model, class, status.",
            ["region", "model", "class", "kind", "status"], registry)
        self.ttft = LabelledHistogram(
            "globalpool_ttft_seconds",
            "Time to first token of streamed requests: arrival at the router to first byte.",
            BY_CLASS, LATENCY_BUCKETS_S, registry)
        self.e2e = LabelledHistogram(
            "globalpool_e2e_seconds", "Arrival at the router to the answer's last byte.",
            BY_CLASS, LATENCY_BUCKETS_S, registry)
        self.itl = LabelledHistogram(
            "globalpool_itl_seconds",
            "Gaps between the chunks of streamed answers as the router passes them on (several "
            "tokens in one read from the worker are one gap): per stream, its gaps observed at "
            "their mean (count and sum exact; buckets by each stream's mean).",
            BY_CLASS, ITL_BUCKETS_S, registry)
        self.prediction_ratio = LabelledHistogram(
            "globalpool_ttft_prediction_ratio",
            "Measured over predicted TTFT per streamed attempt that got a first byte and had "
            "a prediction > 0 (request sent to the worker -> first byte, the span predicted). "
            "Non-streaming attempts are not observed: their first byte is the whole answer.",
            BY_CLASS, RATIO_BUCKETS, registry)
        self.budget = LabelledCounter(
            "globalpool_ttft_budget_requests",
            "Streamed requests with a TTFT budget (x-globalpool-ttft-budget-ms) by whether "
            "the client's TTFT (arrival -> first byte passed on) met it; a stream that never "
            "started is missed (a client that left before its budget ran out: not counted). "
            "Counted when the request ends; non-streaming requests are not counted.",
            [*BY_CLASS, "outcome"], registry)
        self.upstream_ttfb = LabelledHistogram(
            "globalpool_upstream_ttfb_seconds",
            "One attempt: request sent to the worker -> its first byte.",
            ["region"], LATENCY_BUCKETS_S, registry)
        self.route = LabelledHistogram(
            "globalpool_route_seconds",
            "Arrival -> first routing decision (body read, validation, policy).",
            [], ROUTE_BUCKETS_S, registry)
        self.decisions = LabelledCounter(
            "globalpool_routing_decisions",
            "Attempts by why the worker was chosen (local, spillover, retry, ...).",
            ["reason", "region"], registry)
        self.retries = LabelledCounter(
            "globalpool_retries", "Attempts after the first, by the region retried in.",
            ["region"], registry)
        self.attempt_failures = LabelledCounter(
            "globalpool_attempt_failures", "Failed attempts by region and kind of failure.",
            ["region", "failure"], registry)
        self.client_disconnects = LabelledCounter(
            "globalpool_client_disconnects",
            "Requests ended by their client (status 499): it went away (left), or it "
            "stopped reading and was cut off (stalled). Never counted against a worker.",
            ["reason"], registry)
        self.failovers = LabelledCounter(
            "globalpool_stream_failovers",
            "Streams whose worker failed mid-stream, by how they ended: continued on another "
            "worker, finished (only the end was missing), failed (no worker could continue "
            "it), not_continued (not sound to continue: `reason`).",
            ["outcome", "reason"], registry)
        self.hedges = LabelledCounter(
            "globalpool_hedges",
            "Hedged copies of streams sent (router.hedging), by region and how they ended: "
            "won (its first token came first and it answered), lost (the original answered "
            "first, or the client left), failed.", ["region", "outcome"], registry)

    def attempt_finished(self, attempt: Attempt) -> None:
        region = attempt.region
        reason = attempt.reason
        self.decisions.inc((reason, region))
        if reason == "retry":
            self.retries.inc((region,))
        elif reason == "hedge":
            self.hedges.inc((region, "won" if attempt.first_byte_s is not None else
                             "failed" if attempt.failure is not None else "lost"))
        if attempt.failure is not None:
            self.attempt_failures.inc((region, attempt.failure.value))
        ttfb_s = attempt.ttfb_s
        if ttfb_s is not None:
            self.upstream_ttfb.observe((region,), ttfb_s)

    def request_finished(self, record: RequestRecord) -> None:
        served = record.served_by
        if record.attempts:
            region = (served or record.attempts[-1]).region
            model = record.model
            labels = self._model_labels
            if model not in labels:
                if len(labels) >= MAX_MODEL_LABELS:
                    model = OTHER_MODEL
                else:
                    labels.add(model)
        else:
            region = NO_REGION
            model = record.model if record.model in self._known_models() else OTHER_MODEL
        status = record.status
        traffic_class = record.traffic_class or DEFAULT_CLASS
        self.requests.inc((region, model, traffic_class, record.kind,
                           _STATUS_LABELS.get(status) or str(status)))
        if status == 499:
            stalled = any(attempt.client_stalled for attempt in record.attempts)
            self.client_disconnects.inc(("stalled" if stalled else "left",))
        if record.routed_s is not None:
            self.route.observe((), record.routed_s - record.received_s)
        if record.failover is not None:
            self.failovers.inc((record.failover, record.failover_reason or ""))
        if record.stream:
            self._stream_finished(record, region, model, traffic_class)
        if record.continuations:
            served = record.first_streamed  # the client's answer began with it
        if served is None or record.finished_s is None:
            return
        self.e2e.observe((region, model, traffic_class), record.finished_s - record.received_s)

    def _stream_finished(self, record: RequestRecord, region: str, model: str,
                         traffic_class: str) -> None:
        """A streamed request's TTFT, its budget's outcome, and per attempt its chunk
        gaps and measured over predicted TTFT."""
        ttft_s = record.ttft_s
        if ttft_s is not None:
            self.ttft.observe((region, model, traffic_class), ttft_s)
        met = record.ttft_budget_met
        if met is not None:
            self.budget.inc((region, model, traffic_class, "met" if met else "missed"))
        for attempt in record.attempts:
            labels = (attempt.region, model, traffic_class)
            mean_itl_s = attempt.mean_itl_s
            if mean_itl_s is not None:
                self.itl.observe_many(labels, mean_itl_s, attempt.stream_gaps)
            ttfb_s = attempt.ttfb_s
            predicted_ms = attempt.predicted_ttft_ms
            if ttfb_s is not None and predicted_ms > 0.0 and attempt.status == 200:
                self.prediction_ratio.observe(labels, ttfb_s * 1000.0 / predicted_ms)


def metrics_handler(registry: CollectorRegistry,
                    more: Callable[[], Awaitable[bytes]] | None = None,
                    machine: Callable[[bytes], Awaitable[bytes]] | None = None,
                    ) -> Callable[[web.Request], Awaitable[web.Response]]:
    """GET /metrics in Prometheus' text format: the registry's metrics (through `machine`,
    which merges sibling processes' in, router.telemetry.machine), then `more` (text
    written directly, such as FleetCollector.worker_exposition)."""

    async def metrics(_request: web.Request) -> web.Response:
        more_text = await more() if more is not None else b""
        own = generate_latest(registry)
        if machine is not None:
            own = await machine(own)
        return web.Response(body=own + more_text,
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    return metrics
