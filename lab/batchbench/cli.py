"""The `bench-batch` subcommand's flags, and running it. Light to import: the bench (and
matplotlib, openai) load only when it runs."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace
from pathlib import Path

from router.core.cli_args import (
    fraction,
    non_negative_int,
    positive_int,
    positive_number,
    positive_seconds,
)

EXIT_GOALS_NOT_MET = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, type=Path,
                        help="folder for results.json, batch.png, summary.md, timeline.json "
                        "and work/ (the config run, the children's logs, the batch files)")
    parser.add_argument("--config", default="regions.yaml", type=Path,
                        help="the regions and simulated workers (default %(default)s: three "
                        "regions at 2.50 / 2.20 / 1.60 per GPU hour)")
    parser.add_argument("--quick", action="store_true",
                        help="1,000 lines, a 300-line calibration, a 15 s baseline")
    parser.add_argument("--lines", type=positive_int, default=None,
                        help="lines in the batch beside the interactive load (default "
                        "10,000; --quick 1,000)")
    parser.add_argument("--calibration-lines", type=non_negative_int, default=None,
                        help="lines of the batch run alone first, 0 for none (default 1,000; "
                        "--quick 300)")
    parser.add_argument("--baseline-s", type=positive_seconds, default=None,
                        help="seconds of interactive load alone (default 60; --quick 15)")
    parser.add_argument("--interactive-share", type=fraction, default=0.3,
                        help="share of the fleet's slots the interactive rate is sized to "
                        "hold (default %(default)s)")
    parser.add_argument("--rate", type=positive_number, default=None,
                        help="interactive requests/s, instead of sizing it by the share")
    parser.add_argument("--interactive-max-tokens", type=positive_int, default=64,
                        help="tokens per interactive answer (default %(default)s)")
    parser.add_argument("--batch-max-tokens", type=positive_int, default=64,
                        help="tokens per batch answer (default %(default)s)")
    parser.add_argument("--batch-timeout-s", type=positive_seconds, default=None,
                        help="a batch not done by then is cancelled (default 900; --quick 240)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the interactive load")


def run_command(args: argparse.Namespace) -> int:
    """Exit 0 when the run met the goals, 3 when it ran and missed one, 1 on error, 2 on
    bad flags."""
    from lab.batchbench.options import BatchBenchOptions, preset
    from lab.batchbench.report import summary_table
    from lab.batchbench.run import run_bench_batch
    from lab.devstack.children import StackError
    from lab.drill.run import command_line
    from router.config_loader import ConfigError
    from router.event_loop import new_event_loop

    options = preset(BatchBenchOptions(
        out=args.out, config_path=args.config, interactive_share=args.interactive_share,
        rate_per_s=args.rate, interactive_max_tokens=args.interactive_max_tokens,
        batch_max_tokens=args.batch_max_tokens, seed=args.seed, command=command_line(),
    ), quick=args.quick)
    chosen = {name: value for name, value in (
        ("lines", args.lines), ("calibration_lines", args.calibration_lines),
        ("baseline_s", args.baseline_s), ("batch_timeout_s", args.batch_timeout_s))
        if value is not None}
    options = replace(options, **chosen)
    if problems := options.problems():
        print("\n".join(problems), file=sys.stderr)
        return 2

    def say(line: str) -> None:
        print(line, flush=True)

    for name in ("httpx", "httpx2"):  # the openai client's, a line per request at INFO
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger().level))

    loop = new_event_loop()
    try:
        results = loop.run_until_complete(run_bench_batch(options, say))
    except ConfigError as exc:
        print("\n".join(exc.problems), file=sys.stderr)
        return 1
    except (StackError, OSError) as exc:
        print(f"globalpool bench-batch failed: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        loop.close()
    say("")
    say(summary_table(results))
    say(f"results: {args.out / 'results.json'}  plot: {args.out / 'batch.png'}  "
        f"summary: {args.out / 'summary.md'}")
    return 0 if results["goals_met"] else EXIT_GOALS_NOT_MET
