"""The `bench` subcommand's flags, and running it. Light to import: the benchmark
machinery (and matplotlib) load only when a benchmark runs."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from router.core.cli_args import fraction, positive_int, positive_seconds

EXIT_GOALS_NOT_MET = 3
ALL_POLICIES = "predicted_ttft,nearest,round_robin,least_load,power_of_two,random"


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scenario", default="skewed-3region",
                        help="a shipped scenario's name (skewed-3region) or a scenario "
                        "YAML file (default %(default)s)")
    parser.add_argument("--policies", default=ALL_POLICIES,
                        help="comma-separated routing policies, each run on the same trace "
                        "(default %(default)s)")
    parser.add_argument("--out", required=True, type=Path,
                        help="folder for results.json, report.md, the PNGs, the trace, the "
                        "raw per-request records and the children's logs")
    parser.add_argument("--quick", action="store_true",
                        help="the scenario's short variant (for CI)")
    parser.add_argument("--replicas", type=positive_int, default=None,
                        help="router replicas, one per region from the first (default: one "
                        "in every region)")
    parser.add_argument("--trace", dest="trace_path", type=Path, default=None,
                        help="replay this saved trace instead of generating one")
    parser.add_argument("--save-trace", type=Path, default=None,
                        help="also write the trace here (it is always in OUT/trace.jsonl)")
    parser.add_argument("--seed", type=int, default=None,
                        help="trace seed (default: the scenario's)")
    parser.add_argument("--hedge", type=fraction, default=0.0, metavar="FRACTION",
                        help="the routers hedge interactive streams, at most FRACTION of "
                        "them (router.hedging.max_fraction; 0, the default: no hedging). "
                        "Compare runs with and without on the same --seed")
    parser.add_argument("--time-limit", type=positive_seconds, default=None, metavar="SECONDS",
                        help="finish the test bed's runs within this many seconds: the "
                        "waits for idle engines and a calm machine shrink, and a disturbed "
                        "policy is not run again when its rerun would not fit (default: no "
                        "limit)")
    parser.add_argument("--attempts", type=positive_int, default=2,
                        help="run a policy again, up to this many times in all, when the "
                        "load generator fell behind (the machine stalled) (default "
                        "%(default)s)")


def run_bench_command(args: argparse.Namespace) -> int:
    """Exit 0 when the benchmark ran and met every goal it could evaluate, 3 when it ran
    and missed one, 1 when it could not run, 2 on bad arguments."""
    import router.policy.baselines
    import router.policy.predicted_ttft  # noqa: F401 (with baselines: registers the policies)
    from lab.bench.run import BenchOptions, run_bench
    from lab.bench.scenario import ScenarioError
    from lab.devstack.children import StackError
    from router.event_loop import new_event_loop
    from router.policy.base import Policy

    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    unknown = [p for p in policies if p not in Policy.registry]
    if not policies or unknown:
        print(f"--policies: unknown {', '.join(unknown) or '(none given)'} (known: "
              f"{', '.join(sorted(Policy.registry))})", file=sys.stderr)
        return 2
    options = BenchOptions(
        scenario=args.scenario, policies=policies, out=args.out, quick=args.quick,
        replicas=args.replicas, trace_path=args.trace_path, save_trace=args.save_trace,
        seed=args.seed, attempts=args.attempts, hedge=args.hedge,
        time_limit_s=args.time_limit,
        command="globalpool " + " ".join(shlex.quote(arg) for arg in sys.argv[1:]),
    )

    def say(line: str) -> None:
        print(line, flush=True)

    loop = new_event_loop()
    try:
        results = loop.run_until_complete(run_bench(options, say))
    except ScenarioError as exc:
        print("\n".join(exc.problems), file=sys.stderr)
        return 2
    except (ValueError, OSError) as exc:
        print(f"globalpool bench: {exc}", file=sys.stderr)
        return 2
    except StackError as exc:
        print(f"globalpool bench failed: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        loop.close()
    for goal in results["goals"]:
        mark = {True: "met   ", False: "MISSED", None: "not run"}[goal["met"]]
        say(f"goal {mark} {goal['goal']} (measured: {goal['measured']})")
    say(f"report: {args.out / 'report.md'}  results: {args.out / 'results.json'}  plots: "
        f"{args.out / 'ttft_cdf.png'}, {args.out / 'regions_over_time.png'}, "
        f"{args.out / 'prediction_error.png'}")
    return 0 if results["goals_met"] else EXIT_GOALS_NOT_MET

