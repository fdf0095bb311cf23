"""Scrape-time export of the admission's security counters (router.core.stats)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric

from router.core.stats import SecurityStats


def _family(name: str, documentation: str, labels: list[str],
            counts: Mapping[Any, int]) -> CounterMetricFamily:
    """`counts` keys are one label value or a tuple of them, in `labels` order."""
    family = CounterMetricFamily(name, documentation, labels=labels)
    for key, value in counts.items():
        values: Iterable[str] = (key,) if isinstance(key, str) else key
        family.add_metric(list(values), float(value))
    return family


@dataclass(eq=False)  # hashable by identity: the registry keys collectors by it
class SecurityCollector:
    stats: SecurityStats

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        yield _family("globalpool_auth", "Client authentication decisions by outcome.",
                      ["outcome"], stats.auth)
        yield _family("globalpool_rate_limited", "Requests refused (429) by the limit hit.",
                      ["scope", "unit"], stats.rate_limited)
        yield _family("globalpool_rate_limit_decisions",
                      "Rate-limit decisions by where they were made (redis, local).",
                      ["source"], stats.rate_limit_source)
        yield CounterMetricFamily("globalpool_rate_limit_redis_errors",
                                  "Redis errors on the rate-limit path.",
                                  value=float(stats.rate_limit_redis_errors))
        yield _family("globalpool_residency", "Requests of region-limited tenants by outcome.",
                      ["tenant", "region", "outcome"], stats.residency)
        yield CounterMetricFamily("globalpool_residency_violations",
                                  "Attempts sent outside a tenant's regions (must stay 0).",
                                  value=float(stats.residency_violations))
        yield _family("globalpool_heartbeats_dropped", "Heartbeats refused, by reason.",
                      ["reason"], stats.heartbeats_dropped)
        yield CounterMetricFamily("globalpool_heartbeats_verified",
                                  "Heartbeats whose signature checked out.",
                                  value=float(stats.heartbeats_verified))
        yield _family("globalpool_peer_reports_dropped",
                      "Other router replicas' reports of open requests refused, by reason.",
                      ["reason"], stats.peer_reports_dropped)
