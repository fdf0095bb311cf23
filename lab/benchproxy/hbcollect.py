"""The router's heartbeat collector alone, counting what it processes (heartbeat plane).

Runs the real `HeartbeatCollector` (pub/sub, load records, full reads, parsing, the real
`HeartbeatGate` as the router builds it, `Snapshot.build`) against Redis for `--seconds`,
counting messages received on the channel and parsed, and load records read and taken.
Prints JSON with its CPU share of one core; the caller divides that by the heartbeats
published meanwhile, a figure that does not depend on how much CPU a busy shared machine
happens to give the process.

    python -m lab.benchproxy.hbcollect --redis-url URL --prefix P --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import time
from typing import Any

from lab.benchproxy.cpu import tree_cpu_s
from lab.benchproxy.decision import ten_regions
from lab.benchproxy.heartbeats import until_settled
from router.admission.setup import heartbeat_gate
from router.config import DEFAULT_FLEET_VIEW_CPU_SHARE
from router.core.stats import SecurityStats
from router.event_loop import new_event_loop, tune_gc
from router.registry import HeartbeatCollector, SnapshotHolder
from worker import redis_client
from worker.heartbeat_keys import HeartbeatKeys
from worker.signing import parse_keys


async def collect(redis_url: str, prefix: str, seconds: float, keys: str,
                  cpu_share: float = DEFAULT_FLEET_VIEW_CPU_SHARE) -> dict[str, Any]:
    # Unsigned (no keys): believed, as by the bench's router (heartbeat.insecure); without
    # it the gate refuses every heartbeat and this measures refusing, not taking them.
    regions = ten_regions()
    config = regions.model_copy(update={"heartbeat": regions.heartbeat.model_copy(
        update={"insecure": not keys})})
    gate = heartbeat_gate(lambda: config, parse_keys(keys) if keys else {}, SecurityStats())
    holder = SnapshotHolder()
    redis = redis_client.connect(redis_url)
    pubsub_redis = redis_client.connect_pubsub(redis_url)
    collector = HeartbeatCollector(redis=redis, pubsub_redis=pubsub_redis,
                                   keys=HeartbeatKeys(prefix), holder=holder, gate=gate,
                                   cpu_share=lambda: cpu_share)
    task = asyncio.create_task(collector.run())
    async with asyncio.timeout(30):
        await collector.synced.wait()
    await asyncio.sleep(1.0)

    async def interval() -> float:
        return collector.upkeep()["rebuild_interval_seconds"]

    await until_settled(interval)  # start-up is not what keeping the view costs
    before = _counts(collector)
    cpu_before = tree_cpu_s(os.getpid())
    started = time.monotonic()
    builds = collector.builds
    await asyncio.sleep(seconds)
    elapsed = time.monotonic() - started
    builds = collector.builds - builds
    counted = {name: (after - before[name]) / elapsed
               for name, after in _counts(collector).items()}
    cpu_after = tree_cpu_s(os.getpid())
    workers = len(holder.current.workers)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await redis.aclose()
    await pubsub_redis.aclose()
    cpu_s = (cpu_after or 0.0) - (cpu_before or 0.0)
    return {"received_per_s": counted["received"], "parsed_per_s": counted["parsed"],
            "records_read_per_s": counted["records_read"],
            "records_applied_per_s": counted["records_applied"],
            "worker_reads_per_s": counted["worker_reads"],
            "cpu_pct": cpu_s / elapsed * 100,
            "snapshots_per_s": builds / elapsed, "workers": workers, "seconds": elapsed}


def _counts(collector: HeartbeatCollector) -> dict[str, int]:
    return {"received": collector.received_heartbeats, "parsed": collector.parsed_heartbeats,
            "records_read": collector.read_records,
            "records_applied": collector.applied_records,
            "worker_reads": collector.worker_reads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--keys", default="", help="signing keys (key_id:secret) to verify")
    parser.add_argument("--cpu-share", type=float, default=DEFAULT_FLEET_VIEW_CPU_SHARE,
                        help="as the router's router.fleet_view_cpu_share")
    args = parser.parse_args()
    tune_gc()  # as `globalpool router` does
    loop = new_event_loop()
    try:
        result = loop.run_until_complete(collect(args.redis_url, args.prefix, args.seconds,
                                                 args.keys, args.cpu_share))
    finally:
        loop.close()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
