"""One region's emulated network as its knobs say (lab.devstack.netem): read by the data
path for every connection's delay and partition, changed at run time by the control API."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class NetemKnobs:
    """One region's network as the proxy emulates it; mutable at run time."""

    rtt_ms: float = 0.0
    extra_rtt_ms: float = 0.0
    partition: bool = False
    rtt_ms_by_source: Mapping[str, float] = field(default_factory=dict)

    def one_way_s(self, source: str) -> float:
        """Seconds one direction adds for a client at `source` (its IP address)."""
        rtt_ms = self.rtt_ms_by_source.get(source, self.rtt_ms) + self.extra_rtt_ms
        return max(0.0, rtt_ms) / 2000.0

    def describe(self) -> dict[str, Any]:
        return {"rtt_ms": self.rtt_ms, "extra_rtt_ms": self.extra_rtt_ms,
                "partition": self.partition, "rtt_ms_by_source": dict(self.rtt_ms_by_source)}
