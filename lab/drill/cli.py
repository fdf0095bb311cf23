"""The `drill` subcommand's flags, and running it. Light to import: the drill machinery
(and matplotlib) load only when a drill runs."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from router.core.cli_args import (
    non_negative_number,
    positive_int,
    positive_number,
    positive_seconds,
)

SCENARIOS = ("kill-region", "drain-region", "partition-region", "slow-region", "redis-outage",
             "redis-failover", "redis-cluster-failover", "worker-flap")
HOSTILE = "hostile"  # worker faults x client behaviours: flags of its own (drill.hostile.cli)
EXIT_GOALS_NOT_MET = 3


def hostile_argv(argv: Sequence[str]) -> list[str] | None:
    """For `globalpool [--log-level L] drill hostile ARGS...`: the arguments for the
    hostile drill's own parser (ARGS, then the global options); None for any other
    command, which the scenario choices below then parse."""
    rest = list(argv)
    before: list[str] = []
    while rest and rest[0].startswith("--log-level"):
        before.append(rest.pop(0))
        if "=" not in before[-1] and rest:
            before.append(rest.pop(0))
    if rest[:2] != ["drill", HOSTILE]:
        return None
    return rest[2:] + before


def add_drill_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", choices=SCENARIOS,
                        help=f"the fault to drill; or `{HOSTILE}`, worker faults x client "
                        f"behaviours, which takes flags of its own (drill {HOSTILE} --help)")
    parser.add_argument("--out", required=True, type=Path,
                        help="folder for report.json, report.md, timeline.png, raw records "
                        "and the children's logs")
    parser.add_argument("--config", default="regions.yaml", type=Path,
                        help="the regions and simulated workers the drill runs "
                        "(default %(default)s)")
    parser.add_argument("--duration-s", type=positive_seconds, default=None,
                        help="how long the fault lasts (default 30; --quick: 6, "
                        "redis-outage 8, redis-failover and redis-cluster-failover 10)")
    parser.add_argument("--quick", action="store_true",
                        help="short phases (warmup 2 s, before 4 s, after 5 s; as with "
                        "any drill, the load goes on until the target serves again, at most "
                        "60 s after the clear, then 3 s more)")
    parser.add_argument("--region", default=None,
                        help="the region to break (default: the router's own region)")
    parser.add_argument("--rate", type=positive_number, default=20.0,
                        help="requests per second, open loop (default %(default)s)")
    parser.add_argument("--max-tokens", type=positive_int, default=16,
                        help="tokens per streamed answer (default %(default)s)")
    parser.add_argument("--drain-via", choices=("sigterm", "admin", "config"),
                        default="sigterm",
                        help="drain-region: SIGTERM the agents, POST /admin/drain, or "
                        "`drain: true` in (a copy of) regions.yaml")
    parser.add_argument("--extra-rtt-ms", type=non_negative_number, default=300.0,
                        help="slow-region: RTT added to the region's path (default %(default)s)")
    parser.add_argument("--slow-factor", type=positive_number, default=1.0,
                        help="slow-region: also slow the region's engines by this factor")
    parser.add_argument("--redis-mode", choices=("stop", "freeze"), default="stop",
                        help="redis-outage: stop Valkey, or SIGSTOP it (a blackholed server)")
    parser.add_argument("--flap-down-s", type=positive_seconds, default=1.0,
                        help="worker-flap: how long the engine stays dead each time "
                        "(default %(default)s)")
    parser.add_argument("--flap-up-s", type=positive_seconds, default=2.0,
                        help="worker-flap: how long it serves before the next kill "
                        "(default %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the load's randomness (default %(default)s)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="PATH=VALUE",
                        help="change one setting of the config for this drill, e.g. "
                        "router.timeouts.first_byte_s=5 (repeatable)")


def run_drill_command(args: argparse.Namespace) -> int:
    """Exit 0 when the drill ran and met its goals, 3 when it ran and missed one, 1 on error."""
    from lab.devstack.children import StackError
    from lab.drill.run import DrillOptions, command_line, run_drill, with_overrides
    from lab.drill.scenarios import FaultSettings, Scenario
    from router.config_loader import ConfigError, load_config
    from router.event_loop import new_event_loop

    try:
        args.out.mkdir(parents=True, exist_ok=True)
        config = load_config(with_overrides(args.config, args.overrides, args.out))
    except ConfigError as exc:
        print("\n".join(exc.problems), file=sys.stderr)
        return 1
    except (ValueError, OSError) as exc:
        print(f"globalpool drill: {exc}", file=sys.stderr)
        return 2
    region = args.region or config.router.region or next(iter(config.regions))
    if region not in config.regions:
        print(f"--region: no region named {region!r} in {args.config}", file=sys.stderr)
        return 2
    scenario = Scenario.registry[args.scenario]
    fault_s = args.duration_s or (scenario.quick_fault_s if args.quick else scenario.fault_s)
    options = DrillOptions(
        scenario=args.scenario, out=args.out, config_path=args.config,
        settings=FaultSettings(region=region, drain_via=args.drain_via,
                               extra_rtt_ms=args.extra_rtt_ms, slow_factor=args.slow_factor,
                               redis_mode=args.redis_mode, flap_down_s=args.flap_down_s,
                               flap_up_s=args.flap_up_s),
        fault_s=fault_s,
        warmup_s=2.0 if args.quick else 3.0,
        before_s=4.0 if args.quick else 10.0,
        after_s=5.0 if args.quick else 20.0,
        rate_per_s=args.rate, max_tokens=args.max_tokens, seed=args.seed,
        overrides=tuple(args.overrides), command=command_line(),
    )

    def say(line: str) -> None:
        print(line, flush=True)

    loop = new_event_loop()
    try:
        report = loop.run_until_complete(run_drill(options, say))
    except StackError as exc:
        print(f"globalpool drill failed: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        loop.close()
    headline = {k: report[k] for k in ("scenario", "requests", "failed", "time_to_detect_s",
                                       "time_to_reroute_s", "ttft_p99_ms")}
    say(json.dumps(headline))
    for goal in report["goals"]:
        say(f"goal {'met   ' if goal['met'] else 'MISSED'} {goal['goal']} "
            f"(measured: {goal['measured']})")
    if report["load"]["machine_stalled"]:
        say(f"warning: the machine stalled (a request started "
            f"{report['load']['max_start_lag_s']:.2f} s late); the latencies of this run "
            "measure the machine, not the router")
    say(f"report: {args.out / 'report.md'}  timeline: {args.out / 'timeline.png'}")
    return 0 if report["goals_met"] else EXIT_GOALS_NOT_MET
