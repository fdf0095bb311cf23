"""What one `globalpool bench-slow-readers` is: its options, the router's settings for it
and its goals (the command is lab.benchproxy.slow_readers, the run lab.benchproxy.slow_run,
the report lab.benchproxy.slow_report)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

# The router's settings for this bench (`--set` may override them): a stream the router
# does not read for 5 s counts as idle, so that a paused slow reader's stream outlasts
# the idle bound within a run of a minute (the default, 60 s, is longer than a pause at
# 1 KB/s: the router resumes when its buffer to the client has drained to a quarter).
BENCH_SETTINGS = ("router.timeouts.idle_s=5",)
RATIO_GOAL = 1.10
# A round counts for the TTFT goal when the router waited for a CPU at most this long per
# second in both runs: on a machine others load, its queueing for a CPU is the TTFT tail.
QUIET_WAIT_PER_S = 0.05
# Each client streams this share of the time: it keeps its own timetable (one stream every
# stream length / DUTY), as independent users do, instead of starting its next stream the
# moment its last one ended (then a stall that ends many streams at once makes them start
# again at once, every stream length: waves of arrivals that no real population makes).
DUTY = 0.95


@dataclass
class Options:
    """One bench: its clients, its workers' streams and the rounds of A and B runs."""

    out: Path
    streams: int = 2000
    slow_share: float = 0.05
    rounds: int = 3
    window_s: float = 20.0  # streams start within this much of a run's start
    warmup_s: float | None = None  # not in TTFT figures (default: one stream's length)
    workers: int = 10
    # 64 tokens 100 ms apart (10 per second, a large model under load): 20,000 events/s
    # at 2,000 streams, what two shared cores drive without the load generator or the
    # backends setting the pace. Each event ~4 KB, so that a stream (~270 KB) outgrows
    # what the kernel and the router buffer for a slow reader (~150 KB): otherwise the
    # router never has to stop reading a worker for it.
    tokens: int = 64
    gap_ms: float = 100.0  # between two tokens of a stream
    token_chars: int = 4000  # content per token event
    slow_bytes_per_s: float = 1024.0
    slow_rcvbuf_bytes: int = 4096
    overrides: list[str] = field(default_factory=list)  # PATH=VALUE for regions.yaml
    router_tree: Path | None = None  # a checkout whose router to run (default: this one)
    pin: bool = True  # the router alone on the first core, the rest on the others
    say: Callable[[str], None] = print
