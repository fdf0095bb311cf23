"""The process's event loop and garbage collector, tuned for a router (and the lab's tools
that run one)."""

from __future__ import annotations

import asyncio
import gc

# Python's cyclic garbage collector, set for this process: a router holds a large
# long-lived fleet view (~20 objects per worker) and allocates a lot per request and per
# heartbeat. With the default thresholds (700, 10, 10) it collects the young generation
# every few heartbeats and rescans the whole fleet view often: at 10,000 workers and 4 Hz
# that was ~40% of the collector's CPU (`globalpool bench-heartbeats`, BENCHMARKS.md).
GC_THRESHOLDS = (50_000, 20, 100)


def tune_gc() -> None:
    """Freeze what start-up allocated (modules, config) out of every future collection and
    collect the young generations less often (see GC_THRESHOLDS)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when available: it roughly halves the per-request cost of the proxy."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop
