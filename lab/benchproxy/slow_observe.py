"""What bench-slow-readers reads of the router under test, from outside: its /metrics
counters and histograms, the ejections among /admin/status's events, its memory
(/proc/PID/status), how fast it answers GET /health while the load runs (a router
whose event loop stalls answers late: the stall is then in every stream's TTFT too), and
the CPU time of it and the backends and their waits for a CPU (schedstat).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from lab.benchproxy.cpu import tree_cpu_s
from lab.benchproxy.slow_clients import waited_s
from lab.benchproxy.stats import summarize

HOST = "127.0.0.1"
PROBE_EVERY_S = 0.1

# The router's own latency histograms read by this bench, by a short name.
HISTOGRAMS = {"globalpool_ttft_seconds_bucket": "ttft",
               "globalpool_upstream_ttfb_seconds_bucket": "upstream_ttfb"}


def bucket_quantile(counts: dict[str, float], name: str, q: float) -> float | None:
    """The upper bound (ms) of the bucket of `name` (a `HISTOGRAMS` short name) where the
    `q` quantile falls, from cumulative `bucket:NAME:LE` counts; None without samples."""
    prefix = f"bucket:{name}:"
    buckets = sorted((float(k[len(prefix):]), v) for k, v in counts.items()
                     if k.startswith(prefix))
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    return next(le * 1000 for le, cumulative in buckets if cumulative >= q * total)


def counted(text: str) -> dict[str, float]:
    """The /metrics counters this bench reads: `ejections`, `failure:KIND` (attempt
    failures), `status:CODE` (client requests), `queue_exits:HOW` (requests that waited
    for a worker with room), `bucket:NAME:LE` (`HISTOGRAMS`), and any sample named for
    clients."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "globalpool_ejections_total":
                key = "ejections"
            elif sample.name == "globalpool_attempt_failures_total":
                key = f"failure:{sample.labels.get('failure')}"
            elif sample.name == "globalpool_requests_total":
                key = f"status:{sample.labels.get('status')}"
            elif sample.name in HISTOGRAMS:
                key = f"bucket:{HISTOGRAMS[sample.name]}:{sample.labels['le']}"
            elif sample.name == "globalpool_queue_exits_total":
                key = f"queue_exits:{','.join(sorted(sample.labels.values()))}"
            elif "client" in sample.name and not sample.name.endswith("_created"):
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                key = f"{sample.name}{{{labels}}}"
            else:
                continue
            found[key] = found.get(key, 0.0) + sample.value
    return found


async def observe(port: int, token: str) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """The counters (`counted`) and the ejections among /admin/status's recent events."""
    base = f"http://{HOST}:{port}"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        async with session.get(f"{base}/metrics") as answer:
            counters = counted(await answer.text())
        async with session.get(f"{base}/admin/status", params={"workers": "0"},
                               headers={"Authorization": f"Bearer {token}"}) as answer:
            status = await answer.json() if answer.status == 200 else {}
    events = [e for e in status.get("events", []) if "eject" in str(e.get("kind"))]
    return counters, events


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS (resident now) and VmHWM (the most it has been resident) of `pid`, KiB."""
    found = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                found[name] = int(value.split()[0])
    except OSError:
        pass
    return found


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The counters that moved from `before` to `after`, by how much."""
    return {k: v - before.get(k, 0.0) for k, v in sorted(after.items())
            if v - before.get(k, 0.0)}


async def probe_health(port: int, latencies_s: list[float]) -> None:
    """GET /health every PROBE_EVERY_S on one keep-alive connection until cancelled,
    noting each answer's latency (a failed or 5-s-late probe counts as 5 s)."""
    url = f"http://{HOST}:{port}/health"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while True:
            started_s = time.perf_counter()
            try:
                async with session.get(url) as answer:
                    await answer.read()
                latencies_s.append(time.perf_counter() - started_s)
            except (aiohttp.ClientError, TimeoutError):
                latencies_s.append(5.0)
            await asyncio.sleep(max(0.0, PROBE_EVERY_S - (time.perf_counter() - started_s)))


def probe_summary(latencies_s: list[float]) -> dict[str, float]:
    """`probe_health`'s latencies summed up, in ms."""
    return {k: v * 1000 if k != "count" else v for k, v in summarize(latencies_s).items()}


@dataclass
class Readings:
    """What is read of the processes before and after a run's load (CPU and wait in s,
    memory in KiB), for the differences."""

    router_cpu_s: float | None
    router_waited_s: float
    router_memory_kib: dict[str, int]
    backends_cpu_s: float
    backends_waited_s: float

    @classmethod
    def now(cls, router_pid: int, backend_pids: list[int]) -> Readings:
        return cls(tree_cpu_s(router_pid), waited_s(router_pid), memory_kib(router_pid),
                   sum(tree_cpu_s(pid) or 0.0 for pid in backend_pids),
                   sum(waited_s(pid) for pid in backend_pids))


def from_counters(counts: dict[str, float]) -> dict[str, Any]:
    """A run's ejections, attempt failures by kind, other counters, and the router's own
    TTFT and worker TTFB quantiles (to its histogram buckets: every stream, the slow
    readers' too)."""
    return {
        "ejections": int(counts.get("ejections", 0)),
        "failures": {k[8:]: v for k, v in counts.items() if k.startswith("failure:")},
        "counters": {k: v for k, v in counts.items()
                     if k != "ejections" and not k.startswith(("failure:", "bucket:"))},
        "router_view_ms": {f"{name}_{label}": bucket_quantile(counts, name, q)
                           for name in HISTOGRAMS.values()
                           for label, q in (("p50", 0.5), ("p99", 0.99))},
    }


def from_readings(before: Readings, after: Readings, result: dict[str, Any],
                   share: float | None, probes_s: list[float]) -> dict[str, Any]:
    """CPU use and CPU waits (per second of the run), the router's memory and its
    GET /health latencies."""
    wall_s = result["wall_s"]
    cpu_s = (None if before.router_cpu_s is None or after.router_cpu_s is None
             else after.router_cpu_s - before.router_cpu_s)
    return {
        "backends_core_pct": (after.backends_cpu_s - before.backends_cpu_s) / wall_s * 100,
        "loadgen_core_pct": result.pop("loadgen_cpu_s") / wall_s * 100,
        # Waiting for a CPU while runnable, per second of the run (1.0: all the time).
        "cpu_wait_per_s": {
            "router": (after.router_waited_s - before.router_waited_s) / wall_s,
            "backends": (after.backends_waited_s - before.backends_waited_s) / wall_s,
            "loadgen": result.pop("loadgen_waited_s") / wall_s},
        "router": {"cpu_s": cpu_s, "core_share_before": share,
                   "core_pct": None if cpu_s is None else cpu_s / wall_s * 100,
                   "health_probe_ms": probe_summary(probes_s),
                   "rss_before_mib": before.router_memory_kib.get("VmRSS", 0) / 1024,
                   "rss_after_mib": after.router_memory_kib.get("VmRSS", 0) / 1024,
                   "rss_peak_mib": after.router_memory_kib.get("VmHWM", 0) / 1024},
    }
