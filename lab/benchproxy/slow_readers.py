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
from dataclasses import fields
from pathlib import Path

from lab.benchproxy.slow_options import BENCH_SETTINGS, Options

EXIT_GOALS_NOT_MET = 3


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
    from lab.benchproxy.slow_run import BenchError, bench_slow_readers
    from router.event_loop import new_event_loop

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
