"""Scrape-time export of the Responses API's store counters (router.registry.response_store)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, Metric

from router.registry.response_store import ResponseStats


@dataclass(eq=False)  # hashable by identity: the registry keys collectors by it
class ResponsesCollector:
    stats: ResponseStats

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        for name, documentation, counts in (
            ("globalpool_responses_recorded",
             "Stored responses whose holder this replica recorded, by outcome (stored, "
             "local_only: Redis refused the write, no_id: the answer named none).",
             stats.recorded),
            ("globalpool_response_lookups",
             "Requests about a stored response (previous_response_id, GET, cancel) by "
             "outcome: found; unknown, other_tenant, forged, worker_gone, worker_forgot "
             "(answered 404); store_unavailable (503).",
             stats.lookups),
        ):
            family = CounterMetricFamily(name, documentation, labels=["outcome"])
            for outcome, count in counts.items():
                family.add_metric([outcome], float(count))
            yield family
