"""`globalpool bench-slow-readers`: thousands of paced streams through one router, with and
without slow readers among them.

A slow client must never count against the worker that serves it. This load test holds
`--streams` concurrent paced streams (default 2,000) through one router process in front
of `--workers` fake backend processes that heartbeat as ready workers, twice per round:

- run A: every client reads at full speed;
- run B: the same, but `--slow-share` of the clients (default 5 %) are slow readers: a
  small receive buffer and 1 KB/s, so that the router's buffers towards them fill and it
  stops reading their streams from the workers.

Each run reports the other clients' TTFT and errors, what became of the slow readers'
streams (they may be cut by the router's client stall bound: their problem, not an error
of the others), the workers the router ejected and the attempt failures it counted
(/metrics, /admin/status), the router's CPU and memory, and what else the machine did
(how long the router waited for a CPU). The goals: no errors, no ejections, the other
clients' TTFT p99 in B within 10 % of A's (B/A taken within a round, then the median over
the rounds in which the router hardly waited for a CPU). Outputs results.json, report.md
and ttft.png.

Light to import: the bench's machinery loads only when it runs.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field, fields
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
EXIT_GOALS_NOT_MET = 3


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


# The flags that set an Options field of the same name (defaults from Options).
FLAGS = {
    "streams": "concurrent paced streams",
    "slow_share": "share of the clients that read slowly in run B",
    "rounds": "pairs of runs: A (no slow readers), then B (with them)",
    "window_s": "seconds during which streams start, per run",
    "workers": "fake backend processes, each one ready worker of 256 sequences",
    "tokens": "tokens per stream",
    "gap_ms": "between two tokens of a stream",
    "token_chars": "content characters per token event",
    "slow_bytes_per_s": "a slow reader's pace",
    "slow_rcvbuf_bytes": "a slow reader's SO_RCVBUF",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, type=Path, help="folder for results and logs")
    defaults = {f.name: f.default for f in fields(Options)}
    for name, meaning in FLAGS.items():
        default = defaults[name]
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default),
                            default=default, help=f"{meaning} (default %(default)s)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="PATH=VALUE",
                        help="a router setting for the runs, e.g. router.timeouts.idle_s=60 "
                        f"(repeatable; the bench sets {', '.join(BENCH_SETTINGS)})")
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="leave every process to the scheduler instead of the router "
                        "alone on the first core (on a machine others are loading too)")
    parser.add_argument("--router-tree", type=Path, default=None,
                        help="run the router of this checkout (e.g. an older commit, "
                        "`git archive REV | tar -x -C DIR`) instead of this one's")


def run_command(args: argparse.Namespace) -> int:
    """0: the goals were met; 3: the bench ran and missed one; 1: it could not run."""
    from lab.benchproxy.procs import new_event_loop
    from lab.benchproxy.slow_run import BenchError, bench_slow_readers

    positive = ("streams", "rounds", "workers", "tokens", "gap_ms", "window_s",
                "slow_bytes_per_s", "slow_rcvbuf_bytes")
    problems = [f"--{name.replace('_', '-')} must be > 0" for name in positive
                if getattr(args, name) <= 0]
    if not 0 <= args.slow_share < 1:
        problems.append("--slow-share must be within [0, 1)")
    if problems:
        print("; ".join(problems))
        return 2
    options = Options(out=args.out, overrides=args.overrides, router_tree=args.router_tree,
                      pin=args.pin, **{name: getattr(args, name) for name in FLAGS})
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        try:
            document = runner.run(bench_slow_readers(options))
        except BenchError as exc:
            print(f"bench-slow-readers: {exc}")
            return 1
    met = all(ok is True for ok in document["summary"]["goals"].values())
    return 0 if met else EXIT_GOALS_NOT_MET
