"""Scrape-time export of batches (router.batch.runner): this replica's counters, and the
unfinished batches as its last scan saw them (every replica sees the same ones: sum the
counters over replicas, not the per-batch gauges)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from router.batch.runner import BatchRunner


@dataclass(eq=False)  # hashable by identity: the registry keys collectors by it
class BatchCollector:
    runner: BatchRunner

    def collect(self) -> Iterator[Metric]:
        stats = self.runner.stats
        lines = CounterMetricFamily(
            "globalpool_batch_lines",
            "Batch lines this replica ran, by outcome (ok: answered 200; error: another "
            "final answer; retried: 408/429/5xx or not routed, tried again; rerun: the line "
            "already had a result, kept) and the region that served them.",
            labels=["outcome", "region"])
        for (outcome, region), count in sorted(stats.lines.items()):
            lines.add_metric([outcome, region], float(count))
        yield lines
        finished = CounterMetricFamily(
            "globalpool_batches_finished", "Batches this replica finalized, by status.",
            labels=["status"])
        for status, count in sorted(stats.batches.items()):
            finished.add_metric([status], float(count))
        yield finished
        cost = CounterMetricFamily(
            "globalpool_batch_cost_estimate_dollars",
            "A rough cost of the batch lines this replica had served, by region: each "
            "line's time on its worker x the region's cost_per_gpu_hour / the worker's "
            "max_num_seqs.", labels=["region"])
        for region, dollars in sorted(stats.cost.items()):
            cost.add_metric([region], dollars)
        yield cost
        requests = GaugeMetricFamily(
            "globalpool_batch_requests",
            "Lines of each unfinished batch by state (completed, failed, pending), from "
            "Redis as this replica last saw them.", labels=["batch", "state"])
        for batch in self.runner.seen.values():
            done = batch.count("completed") + batch.count("failed")
            for state, value in (("completed", batch.count("completed")),
                                 ("failed", batch.count("failed")),
                                 ("pending", max(0, batch.total - done))):
                requests.add_metric([batch.id, state], float(value))
        yield requests
        here = self.runner.status()["here"]
        running = GaugeMetricFamily("globalpool_batch_lines_running",
                                    "Batch lines this replica has in flight now.")
        running.add_metric([], float(here["lines_running"]))
        yield running
