"""What the routers saw: the heartbeats in Redis, read once a second during a run.

The routing policies predict from heartbeats (load, and the engines' recent performance:
mean e2e time and "prefill tokens/s"). Recording them next to what clients measured
shows how good the prediction's inputs were. Read-only: the bench never writes to Redis.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as redis
from pydantic import ValidationError

from worker.heartbeat_keys import HeartbeatKeys
from worker.schema import Heartbeat


@dataclass
class HeartbeatWatch:
    """Samples every heartbeat each `interval_s` until cancelled."""

    redis_url: str
    key_prefix: str
    interval_s: float = 1.0
    samples: list[tuple[float, Heartbeat]] = field(default_factory=list)

    async def run(self, now_s: Callable[[], float]) -> None:
        keys = HeartbeatKeys(self.key_prefix)
        client = redis.Redis.from_url(self.redis_url, socket_timeout=1.0)
        try:
            while True:
                at = now_s()
                try:
                    names = [name async for name in client.scan_iter(match=keys.pattern)]
                    values = await client.mget(names) if names else []
                except (redis.RedisError, OSError):
                    values = []
                for value in values:
                    if value is None:
                        continue
                    try:
                        self.samples.append((at, Heartbeat.from_json(value)))
                    except ValidationError:
                        continue
                await asyncio.sleep(max(0.0, self.interval_s - (now_s() - at)))
        finally:
            await client.aclose()

    def summary(self) -> dict[str, Any]:
        """Per region: the performance figures routers predicted from (median, min, max
        over the run's samples), and how often a worker had none yet."""
        by_region: dict[str, list[Heartbeat]] = {}
        for _, heartbeat in self.samples:
            by_region.setdefault(heartbeat.region, []).append(heartbeat)
        return {region: {
            "samples": len(beats),
            "prefill_tokens_per_s": _spread(b.performance.prefill_tokens_per_s for b in beats),
            "e2e_ms": _spread(b.performance.e2e_ms for b in beats),
            "ttft_ms": _spread(b.performance.ttft_ms for b in beats),
            "no_performance_yet": sum(b.performance.e2e_ms is None for b in beats),
        } for region, beats in sorted(by_region.items())}


def _spread(values: Any) -> dict[str, float | None]:
    known = [float(v) for v in values if v is not None]
    if not known:
        return {"median": None, "min": None, "max": None}
    return {"median": round(statistics.median(known), 1), "min": round(min(known), 1),
            "max": round(max(known), 1)}
