"""`globalpool`: one command, one subcommand per job.

    globalpool up                      # Valkey + simulated regions + router, on this machine
    globalpool router --region R       # one router replica
    globalpool worker --region R --engine-url URL
    globalpool sim --port P            # the engine simulator
    globalpool check-config FILE
    globalpool drill SCENARIO --out DIR [--quick]   # failover drill under load (DRILLS.md)
    globalpool drill hostile --out DIR [--quick]    # worker faults x client behaviours
    globalpool bench --out DIR [--quick]         # routing policies on one trace (BENCHMARKS.md)
    globalpool bench-proxy --out DIR [--quick]   # proxy cost vs peer routers (BENCHMARKS.md)
    globalpool bench-batch --out DIR [--quick]   # a batch beside interactive load (BENCHMARKS.md)
    globalpool bench-memory [--tree DIR]         # router RSS over 100,000 requests, https
    globalpool bench-instructions [--tree DIR]   # instructions per request (callgrind)
    globalpool bench-slow-readers --out DIR      # slow readers among 2,000 streams (DRILLS.md)
    globalpool status [--router URL] [--watch]   # regions and workers, from the admin API
    globalpool batch submit FILE.jsonl           # OpenAI's Batch API, with a progress bar
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from router import lab_commands
from router.config import GlobalConfig, redis_url_problem
from router.config_loader import ConfigError, load_config
from router.core.cli_args import port_number

DEFAULT_CONFIG = "regions.yaml"


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    with_lab = lab_commands.lab_available()
    if with_lab:
        hostile = lab_commands.hostile_drill(arguments)
        if hostile is not None:
            return hostile
    parser = build_parser(with_lab=with_lab)
    # Known arguments only: a lab subcommand without the lab takes any (and says how to
    # get the lab); everywhere else the unknown ones are refused as parse_args would.
    args, unknown = parser.parse_known_args(arguments)
    lab_command: str | None = getattr(args, "lab_command", None)
    if lab_command is not None:
        print(lab_commands.missing_lab_message(lab_command), file=sys.stderr)
        return 2
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    code: int = args.run(args)
    return code


def build_parser(*, with_lab: bool | None = None) -> argparse.ArgumentParser:
    """The `globalpool` parser with every subcommand (`drill hostile` has a parser of its
    own, lab.drill.hostile.cli.build_parser, which `main` dispatches to first). The lab's
    subcommands are configured by the lab when it is importable (`with_lab`, default:
    whether it is) and otherwise only say how to get it (router.lab_commands)."""
    if with_lab is None:
        with_lab = lab_commands.lab_available()
    parser = argparse.ArgumentParser(
        prog="globalpool", description="A multi-region global request router for LLM inference."
    )
    parser.add_argument("--log-level", default=os.environ.get("GLOBALPOOL_LOG_LEVEL", "INFO"),
                        help="DEBUG, INFO, WARNING or ERROR (default: GLOBALPOOL_LOG_LEVEL, "
                        "then INFO)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add_lab(name: str, help_text: str,
                add_arguments: lab_commands.Configure | None = None) -> None:
        lab_commands.add_lab_command(commands, name, help_text, with_lab=with_lab,
                                     add_arguments=add_arguments)

    add_lab("up", "run the whole system on this machine (simulated GPUs)", _add_up_arguments)

    router = commands.add_parser("router", help="run one router replica")
    router.add_argument("--config", default=DEFAULT_CONFIG,
                        help="regions.yaml to route by, reloaded when it changes "
                        "(default %(default)s)")
    router.add_argument("--region", default=None, help="this replica's region (default: config)")
    router.add_argument("--host", default=None, help="address to listen on (default: config)")
    router.add_argument("--port", type=port_number, default=None,
                        help="port to listen on (default: config)")
    router.add_argument("--redis-url", default=None, help="default: REDIS_URL, then the config")
    router.add_argument("--policy", default=None, help="routing policy (default: the config's)")
    router.add_argument("--seed", type=int, default=None, help="seed routing randomness")
    router.add_argument("--processes", type=_processes,
                        default=os.environ.get("GLOBALPOOL_ROUTER_PROCESSES"),
                        help="serving processes on the port (default: "
                        "GLOBALPOOL_ROUTER_PROCESSES, else the cores this process may use; "
                        "1: one process, no supervisor)")
    router.set_defaults(run=_run_router)

    worker = commands.add_parser("worker", help="run the agent beside one vLLM server")
    from worker.cli import add_worker_arguments, run_worker

    add_worker_arguments(worker)
    worker.set_defaults(run=run_worker)

    add_lab("sim", "run the engine simulator (a stand-in for vLLM)")
    add_lab("bench-proxy", "router CPU per request vs peer routers (fake backends)")
    add_lab("bench-decision", "cost of one routing decision at 10..10,000 workers")
    add_lab("bench-heartbeats", "router CPU to follow 10,000 workers heartbeating at 4 Hz")
    add_lab("bench-instructions",
            "the router's instructions per proxied request under callgrind, per source tree")
    add_lab("bench-slow-readers",
            "2,000 paced streams through one router, with and without 5%% slow readers")

    from router.compiled import add_parser as add_compile_parser

    add_compile_parser(commands)

    add_lab("bench-memory", "router memory over 100,000 requests with new header lines, "
            "and with 10,000 https workers")
    add_lab("bench", "routing policies side by side on one multi-region trace")
    add_lab("bench-batch", "interactive TTFT and batch throughput with a batch running")
    add_lab("drill", "a failover drill under load (kill-region, ...)")

    check = commands.add_parser("check-config", help="validate a regions.yaml")
    check.add_argument("file", nargs="?", default=DEFAULT_CONFIG,
                       help="the regions.yaml to check (default %(default)s)")
    check.set_defaults(run=_run_check_config)

    _add_batch_command(commands)
    status = commands.add_parser("status", help="regions and workers from a router's admin API")
    from router.admin.table import add_status_arguments, run_status

    add_status_arguments(status)
    status.set_defaults(run=run_status)
    return parser


def _add_up_arguments(up: argparse.ArgumentParser) -> None:
    up.add_argument("--config", default=DEFAULT_CONFIG,
                    help="the regions, models and simulated workers to run (default %(default)s)")
    up.add_argument("--host", default=None, help="router address (default: from the config)")
    up.add_argument("--port", type=port_number, default=None,
                    help="router port (default: from config)")
    up.add_argument("--state-file", default=None, help="write the PIDs and URLs as JSON here")
    up.add_argument("--log-dir", default=None, help="children's logs (default: a temp folder)")
    up.set_defaults(run=_run_up)


def _load_or_report(path: str, *, policy_override: str | None = None) -> GlobalConfig | None:
    """The config a router would run (schema and `runtime_problems`), or None after
    printing every problem, one line each."""
    from router.config_checks import runtime_problems

    try:
        config = load_config(path)
    except ConfigError as exc:
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        return None
    problems = runtime_problems(config, policy_override=policy_override)
    for problem in problems:
        print(f"{path}: {problem}", file=sys.stderr)
    return None if problems else config


def _run_check_config(args: argparse.Namespace) -> int:
    config = _load_or_report(args.file)
    if config is None:
        return 1
    workers = sum(region.simulated.workers for region in config.regions.values())
    print(
        f"{args.file}: OK ({len(config.regions)} regions: {', '.join(config.regions)}; "
        f"models: {', '.join(config.models)}; {workers} simulated workers for `up`)"
    )
    return 0


def resolve_redis_url(flag: str | None, config: GlobalConfig) -> str | None:
    """--redis-url, then REDIS_URL, then the config; None when only 'embedded' is left."""
    url = flag or os.environ.get("REDIS_URL") or config.redis.url
    return None if url == "embedded" else url


def _run_router(args: argparse.Namespace) -> int:
    from router.processes import ProcessSlot, follow_supervisor, supervise, usable_cores

    config = _load_or_report(args.config, policy_override=args.policy)
    if config is None:
        return 1
    if not _tokens_usable(config):
        return 2
    redis_url = resolve_redis_url(args.redis_url, config)
    if redis_url is None:
        print("no Redis URL: pass --redis-url or set REDIS_URL "
              "(`globalpool up` starts an embedded one)", file=sys.stderr)
        return 2
    problem = redis_url_problem(redis_url)
    if problem is not None:
        source = "--redis-url" if args.redis_url else "REDIS_URL"
        print(f"{source}: {problem}", file=sys.stderr)
        return 2
    region = args.region or config.router.region
    if region is not None and region not in config.regions:
        print(f"--region: no region named {region!r} in {args.config}", file=sys.stderr)
        return 2
    host = args.host or config.router.host
    port = args.port if args.port is not None else config.router.port
    slot = ProcessSlot.from_environ(os.environ)
    cores = usable_cores()
    processes = args.processes if args.processes is not None else cores
    if slot is None and processes > cores:
        print(f"note: {processes} router processes on {cores} core(s): processes that share "
              "a core cost more CPU per request (~16 % for paced streams, BENCHMARKS.md) "
              "and each holds its own memory; the default is one per core", file=sys.stderr)
    if slot is None and processes > 1:
        try:
            return supervise(_process_args(args), processes, host, port,
                             {**os.environ, "REDIS_URL": redis_url})
        except OSError as exc:
            print(f"cannot listen: {exc}", file=sys.stderr)
            return 1
    if slot is not None and not follow_supervisor(slot):
        print("router process: its supervisor is gone; not serving", file=sys.stderr)
        return 1
    from router.app import RouterSettings, run  # (not in a supervisor: it serves nothing)

    seed = args.seed if args.seed is None or slot is None else args.seed + slot.index
    settings = RouterSettings(
        config=config, redis_url=redis_url, region=region, policy=args.policy, seed=seed,
        config_path=Path(args.config), process=slot,
    )
    try:
        run(settings, host, port)
    except ValueError as exc:  # an unknown policy name
        print(str(exc), file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"cannot listen: {exc}", file=sys.stderr)
        return 1
    return 0


def _processes(text: str) -> int:
    try:
        count = int(text)
    except ValueError:
        count = 0
    if not 1 <= count <= 1024:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of processes (1-1024)")
    return count


def _process_args(args: argparse.Namespace) -> list[str]:
    """The arguments of each process under the supervisor: this command's, one process
    each, its Redis URL in the environment (REDIS_URL) rather than on a command line
    that every user can read."""
    child = ["--log-level", args.log_level, "router", "--config", args.config,
             "--processes", "1"]
    for flag, value in (("--region", args.region), ("--policy", args.policy),
                        ("--seed", args.seed)):
        if value is not None:
            child += [flag, str(value)]
    return child


def _run_up(args: argparse.Namespace) -> int:
    config = _load_or_report(args.config)
    if config is None:
        return 1
    if not _tokens_usable(config):
        return 2
    return lab_commands.run_up(args, config)


def _tokens_usable(config: GlobalConfig) -> bool:
    """Say why, and False, if an admin or scrape token in the environment is too short."""
    from router.admin.auth import token_problems

    problems = token_problems(config.admin, os.environ)
    for problem in problems:
        print(problem, file=sys.stderr)
    return not problems


def _add_batch_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from router.batch.command import add_arguments

    add_arguments(commands.add_parser("batch", help="submit a JSONL file as a batch, follow "
                                      "it, fetch its results (OpenAI's Batch API)"))


if __name__ == "__main__":
    sys.exit(main())
