"""The router's heartbeat collector alone, counting what it processes (heartbeat plane).

Runs the real `HeartbeatCollector` (pub/sub + full reads, parsing, the real
`HeartbeatGate` as the router builds it, `Snapshot.build`) against Redis for `--seconds`,
counting what it receives and what it parses (only each worker's newest between two
builds is parsed). Prints JSON: heartbeats received per second and CPU microseconds per
received heartbeat, a figure that does not depend on how much CPU a busy shared machine
happens to give the process.

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
from router.benchproxy.cpu import tree_cpu_s
from router.benchproxy.decision import ten_regions
from router.benchproxy.procs import new_event_loop
from router.registry import HeartbeatCollector, SnapshotHolder
from worker import redis_client
from worker.schema import HeartbeatKeys
from worker.signing import parse_keys


async def collect(redis_url: str, prefix: str, seconds: float, keys: str) -> dict[str, Any]:
    config = ten_regions()
    gate = heartbeat_gate(lambda: config, parse_keys(keys) if keys else {}, SecurityStats())
    holder = SnapshotHolder()
    redis = redis_client.connect(redis_url)
    pubsub_redis = redis_client.connect_pubsub(redis_url)
    collector = HeartbeatCollector(redis=redis, pubsub_redis=pubsub_redis,
                                   keys=HeartbeatKeys(prefix), holder=holder, gate=gate)
    task = asyncio.create_task(collector.run())
    await asyncio.wait_for(collector.synced.wait(), 30)
    await asyncio.sleep(1.0)
    received_before, parsed_before = collector.received_heartbeats, collector.parsed_heartbeats
    cpu_before = tree_cpu_s(os.getpid())
    started = time.monotonic()
    builds = 0
    last = holder.current
    while time.monotonic() - started < seconds:  # count snapshot replacements, ~1 ms apart
        await asyncio.sleep(0.001)
        if holder.current is not last:
            builds += 1
            last = holder.current
    elapsed = time.monotonic() - started
    seen = collector.received_heartbeats - received_before
    parsed = collector.parsed_heartbeats - parsed_before
    cpu_after = tree_cpu_s(os.getpid())
    workers = len(holder.current.workers)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await redis.aclose()
    await pubsub_redis.aclose()
    cpu_s = (cpu_after or 0.0) - (cpu_before or 0.0)
    return {"processed_per_s": seen / elapsed, "parsed_per_s": parsed / elapsed,
            "cpu_pct": cpu_s / elapsed * 100,
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
