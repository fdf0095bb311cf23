"""`globalpool bench-decision`: the cost of one routing decision, as the proxy makes it.

For 10, 100, 1,000 and 10,000 workers spread over 10 regions: real `Heartbeat` objects
(varied load, KV usage and performance), `Snapshot.build`, and the real
`policy.pick(snapshot, RouteRequest(...))` of `predicted_ttft` with this router's in-flight
counts, the health filter and the real clock, exactly as `router.proxy.handlers` calls it.
Each call is timed with perf_counter_ns; iterations are bounded in count and time.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

from lab.benchproxy.stats import summarize
from router.config import GlobalConfig
from router.health import Health
from router.policy import RouteRequest, RoutingContext, create_policy
from router.registry.inflight import InFlight
from router.registry.snapshot import Snapshot
from router.registry.worker_view import WorkerView
from worker.schema import Capacity, Heartbeat, LifecycleState, Load, Performance

REGIONS = [f"region-{i}" for i in range(10)]
MODEL = "bench"
OTHER_MODEL = "other-model"  # a third of the fleet serves it too
MIN_ITERATIONS = 20


def ten_regions() -> GlobalConfig:
    """A regions.yaml of 10 regions (RTT 1 ms inside, 30-110 ms between, each pair given
    once), so the policy reads RTTs through the router's own `GlobalConfig.rtt_ms`."""
    return GlobalConfig.model_validate({
        "apiVersion": "globalpool/v1",
        "regions": {a: {"models": [MODEL, OTHER_MODEL], "rtt_ms": {
            b: 1.0 if i == j else 10.0 * abs(i - j) + 20.0
            for j, b in enumerate(REGIONS) if j >= i}} for i, a in enumerate(REGIONS)},
    })


def fleet(workers: int, rng: random.Random, now_s: float) -> list[WorkerView]:
    views = []
    for i in range(workers):
        slots = rng.choice((16, 32, 64, 128))
        running = rng.randint(0, slots)
        heartbeat = Heartbeat(
            worker_id=f"w-{i:05d}", region=REGIONS[i % len(REGIONS)],
            endpoint=f"http://10.{i // 65536}.{i // 256 % 256}.{i % 256}:8000",
            models=(MODEL, OTHER_MODEL) if i % 3 == 0 else (MODEL,),
            state=LifecycleState.READY if i % 50 else LifecycleState.DRAINING,
            capacity=Capacity(max_num_seqs=slots, kv_blocks_total=8192, block_size_tokens=16),
            load=Load(running=running, waiting=rng.randint(0, 4) if running == slots else 0,
                      kv_cache_usage=rng.uniform(0.0, 0.97)),
            performance=Performance(ttft_ms=rng.uniform(20, 200), itl_ms=rng.uniform(5, 30),
                                    e2e_ms=rng.uniform(500, 4000),
                                    prefill_tokens_per_s=rng.uniform(2000, 20000)),
            seq=1, sent_at_s=time.time(), ttl_s=3600.0,
        )
        views.append(WorkerView(heartbeat, received_at_s=now_s,
                                inflight_at_receipt=rng.randint(0, 2)))
    return views


def measure(workers: int, *, max_iterations: int, time_budget_s: float,
            seed: int = 1) -> dict[str, Any]:
    rng = random.Random(seed)
    now_s = time.monotonic()
    views = fleet(workers, rng, now_s)
    build_s = []
    for _ in range(5):  # CPU time, as above
        started = time.process_time()
        snapshot = Snapshot.build(views, built_at_s=now_s, redis_connected=True,
                                  last_redis_ok_at_s=now_s)
        build_s.append(time.process_time() - started)
    inflight = InFlight()
    for view in rng.sample(views, min(len(views), 50)):
        inflight.started(view.worker_id)
    policy = create_policy("predicted_ttft", RoutingContext(
        rtt_ms=ten_regions().rtt_ms, inflight=inflight, rng=random.Random(seed), near_equal_ms=5.0,
        health=Health()))
    requests = [RouteRequest(model=MODEL, origin_region=rng.choice(REGIONS),
                             prompt_tokens=rng.randint(10, 2000), stream=True)
                for _ in range(64)]
    for request in requests:  # warm-up
        policy.pick(snapshot, request)
    samples_ns: list[int] = []
    pick = policy.pick
    clock = time.perf_counter_ns
    deadline = time.monotonic() + time_budget_s
    cpu_started = time.process_time()
    index = 0
    # At least MIN_ITERATIONS calls (so that a p99 means something), then until the
    # count or the time budget runs out.
    while len(samples_ns) < MIN_ITERATIONS or (
            len(samples_ns) < max_iterations and time.monotonic() < deadline):
        request = requests[index % len(requests)]
        index += 1
        started = clock()
        pick(snapshot, request)
        samples_ns.append(clock() - started)
    cpu_us = (time.process_time() - cpu_started) / len(samples_ns) * 1e6
    summary = summarize([ns / 1000.0 for ns in samples_ns])
    return {
        "workers": workers, "regions": len(REGIONS), "iterations": len(samples_ns),
        "decision_us": summary,
        # CPU time per call (process_time over the loop, timer calls included): unlike the
        # wall-clock percentiles, not inflated when a shared machine preempts the process.
        "cpu_us_per_decision": cpu_us,
        "snapshot_build_ms": sorted(build_s)[len(build_s) // 2] * 1000,
    }


def render(results: list[dict[str, Any]]) -> str:
    lines = ["| workers | decision p50 (us) | p99 (us) | mean (us) | CPU per decision (us) | "
             "iterations | Snapshot.build, CPU (ms) |", "|---|---|---|---|---|---|---|"]
    for r in results:
        d = r["decision_us"]
        lines.append(f"| {r['workers']:,} | {d['p50']:.1f} | {d['p99']:.1f} | {d['mean']:.1f} | "
                     f"{r['cpu_us_per_decision']:.1f} | {r['iterations']:,} | "
                     f"{r['snapshot_build_ms']:.2f} |")
    return "\n".join(lines)


def main(*, sizes: list[int], quick: bool, out: Path | None) -> int:
    results = []
    for workers in sizes:
        budget_s = 0.5 if quick else 5.0
        iterations = 2_000 if quick else 50_000
        result = measure(workers, max_iterations=iterations, time_budget_s=budget_s)
        results.append(result)
        d = result["decision_us"]
        print(f"{workers:>6} workers: decision p50 {d['p50']:8.1f} us, p99 {d['p99']:8.1f} us, "
              f"CPU {result['cpu_us_per_decision']:.1f} us/call ({result['iterations']} calls); "
              "Snapshot.build "
              f"{result['snapshot_build_ms']:.2f} ms", flush=True)
    print()
    print(render(results))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "decision.json").write_text(json.dumps(results, indent=1))
        (out / "decision.md").write_text(render(results) + "\n")
    return 0
