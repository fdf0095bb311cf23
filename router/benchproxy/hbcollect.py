"""The router's heartbeat collector alone, counting what it processes (heartbeat plane).

Runs the real `HeartbeatCollector` (pub/sub + full reads, parsing, the real
`HeartbeatGate` as the router builds it, `Snapshot.build`) against Redis for `--seconds`,
with the gate wrapped to count every heartbeat it is asked about. Prints JSON: heartbeats
processed per second and CPU microseconds per processed heartbeat, a figure that does not
depend on how much CPU a busy shared machine happens to give the process.

    python -m router.benchproxy.hbcollect --redis-url URL --prefix P --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import time
from typing import Any

from router.admission.setup import heartbeat_gate
from router.admission.stats import SecurityStats
from router.app import tune_gc
from router.auth.heartbeats import HeartbeatGate
from router.benchproxy.cpu import tree_cpu_s
from router.benchproxy.decision import ten_regions
from router.benchproxy.procs import new_event_loop
from router.registry import HeartbeatCollector, SnapshotHolder
from worker import redis_client
from worker.schema import Heartbeat, HeartbeatKeys
from worker.signing import parse_keys


class CountingGate:
    """The real gate, counting the heartbeats it sees (processed = parsed + checked)."""

    def __init__(self, gate: HeartbeatGate) -> None:
        self.gate = gate
        self.seen = 0

    def check(self, heartbeat: Heartbeat, *, via_pubsub: bool) -> str | None:
        self.seen += 1
        return self.gate.check(heartbeat, via_pubsub=via_pubsub)

    @property
    def signing(self) -> bool:
        return self.gate.signing


async def collect(redis_url: str, prefix: str, seconds: float, keys: str) -> dict[str, Any]:
    config = ten_regions()
    gate = CountingGate(heartbeat_gate(lambda: config, parse_keys(keys) if keys else {},
                                       SecurityStats()))
    holder = SnapshotHolder()
    redis = redis_client.connect(redis_url)
    pubsub_redis = redis_client.connect_pubsub(redis_url)
    collector = HeartbeatCollector(redis=redis, pubsub_redis=pubsub_redis,
                                   keys=HeartbeatKeys(prefix), holder=holder, gate=gate)
    task = asyncio.create_task(collector.run())
    await asyncio.wait_for(collector.synced.wait(), 30)
    await asyncio.sleep(1.0)
    seen_before, cpu_before = gate.seen, tree_cpu_s(os.getpid())
    started = time.monotonic()
    builds = 0
    last = holder.current
    while time.monotonic() - started < seconds:  # count snapshot replacements, ~1 ms apart
        await asyncio.sleep(0.001)
        if holder.current is not last:
            builds += 1
            last = holder.current
    elapsed = time.monotonic() - started
    seen, cpu_after = gate.seen - seen_before, tree_cpu_s(os.getpid())
    workers = len(holder.current.workers)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await redis.aclose()
    await pubsub_redis.aclose()
    cpu_s = (cpu_after or 0.0) - (cpu_before or 0.0)
    return {"processed_per_s": seen / elapsed, "cpu_pct": cpu_s / elapsed * 100,
            "cpu_us_per_heartbeat": cpu_s / seen * 1e6 if seen else None,
            "snapshots_per_s": builds / elapsed, "workers": workers, "seconds": elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--keys", default="", help="signing keys (key_id:secret) to verify")
    args = parser.parse_args()
    tune_gc()  # as `globalpool router` does
    loop = new_event_loop()
    try:
        result = loop.run_until_complete(collect(args.redis_url, args.prefix, args.seconds,
                                                 args.keys))
    finally:
        loop.close()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
