"""Arguments of `globalpool bench-proxy`, `bench-decision`, `bench-heartbeats` and
`bench-instructions`.

Kept free of heavy imports: `globalpool` builds every subcommand's parser at start.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from router.config import DEFAULT_FLEET_VIEW_CPU_SHARE
from router.core.cli_args import fraction, positive_int, positive_number, positive_seconds


def add_bench_proxy_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, type=Path, help="folder for results and logs")
    parser.add_argument("--quick", action="store_true",
                        help="small workloads (a CI smoke test: < 60 s without peers)")
    parser.add_argument("--only", default=None,
                        help="comma-separated routers: globalpool,aiohttp,vllm-router,"
                             "sglang-router,envoy (default: all; `direct` always runs), and, "
                             "only when named: globalpool-fleet (globalpool following 10,000 "
                             "more workers heartbeating at 4 Hz) and its control "
                             "globalpool-fleet-elsewhere (the same heartbeats, not followed); "
                             "globalpool-compiled-2p (the compiled build with 2 router "
                             "processes on the same router core; CPU is its whole process "
                             "tree's; compare with --only "
                             "globalpool-compiled,globalpool-compiled-2p)")
    parser.add_argument("--rounds", type=positive_int, default=1,
                        help="repeat the whole comparison this many times (default 1)")
    parser.add_argument("--peers-dir", type=Path, default=None,
                        help="virtualenv for the peer routers (default: "
                             "~/.cache/globalpool/bench-peers)")
    parser.add_argument("--workloads", default=None,
                        help="comma-separated workloads to measure: unary,stream,paced "
                             "(default: all three)")
    parser.add_argument("--fleet-workers", type=positive_int, default=10_000,
                        help="workers globalpool-fleet follows (default 10,000, at 4 Hz)")
    parser.add_argument("--profile", default="",
                        help="comma-separated workloads (unary,stream,paced) to profile "
                             "globalpool under with py-spy, after the measurements")
    parser.add_argument("--throughput", action="store_true",
                        help="instead of the comparison: requests/s, latency p50/p99 and "
                             "router CPU per request under wrk (Debian's `wrk`, -t1) for the "
                             "compiled build with 1 and 2 router processes, unpinned (the "
                             "router may use every core, shared with wrk and the backends) and "
                             "pinned (router processes on one core); alternating, --rounds "
                             "times; writes throughput.json/.md/.png (see "
                             "lab/benchproxy/throughput.py). --quick: 3 s runs")
    parser.add_argument("--wrk-seconds", type=positive_seconds, default=10.0,
                        help="--throughput: seconds of each measured wrk run (default 10)")
    parser.add_argument("--wrk-connections", type=positive_int, default=32,
                        help="--throughput: wrk's connections (default 32)")
    parser.add_argument("--unpinned-only", action="store_true",
                        help="--throughput: skip the pinned variant")


def run_bench_proxy(args: argparse.Namespace) -> int:
    if args.throughput:
        return _run_throughput(args)
    from lab.benchproxy.run import Options, bench_proxy
    from router.event_loop import new_event_loop

    options = Options(
        out=args.out, quick=args.quick, rounds=args.rounds, peers_dir=args.peers_dir,
        only=_names(args.only),
        profile=[w.strip() for w in args.profile.split(",") if w.strip()],
        workloads=_names(args.workloads), fleet_workers=args.fleet_workers,
    )
    loop = new_event_loop()
    try:
        document = loop.run_until_complete(bench_proxy(options))
    except ValueError as exc:
        print(str(exc))
        return 2
    finally:
        loop.close()
    print(f"wrote {args.out / 'results.json'}, {args.out / 'report.md'}, "
          f"{args.out / 'cpu_per_request.png'}")
    ran = [r for r in document["results"] if r.get("completed")]
    return 0 if ran else 1


def _run_throughput(args: argparse.Namespace) -> int:
    from lab.benchproxy.throughput import ThroughputOptions, bench_throughput

    options = ThroughputOptions(
        out=args.out, rounds=args.rounds,
        seconds=3.0 if args.quick else max(1.0, args.wrk_seconds),
        connections=args.wrk_connections, pinned=not args.unpinned_only)
    document = _run_unless_unavailable("bench-proxy --throughput", bench_throughput(options))
    if document is None:
        return 2
    print(f"wrote {args.out / 'throughput.json'}, {args.out / 'throughput.md'}, "
          f"{args.out / 'throughput.png'}")
    return 0 if all(r.get("status") == "ok" for r in document["results"]) else 1


def _names(text: str | None) -> list[str] | None:
    """`a, b` -> ["a", "b"]; None (the option was not given) stays None."""
    return [n.strip() for n in text.split(",") if n.strip()] if text else None


def add_bench_decision_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=None, help="write decision.json here")
    parser.add_argument("--quick", action="store_true", help="fewer iterations")
    parser.add_argument("--sizes", default="10,100,1000,10000",
                        help="comma-separated worker counts (default 10,100,1000,10000)")


def run_bench_decision(args: argparse.Namespace) -> int:
    from lab.benchproxy.decision import main

    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    return main(sizes=sizes, quick=args.quick, out=args.out)


def add_bench_heartbeats_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=None, help="write heartbeats.json here")
    parser.add_argument("--workers", type=positive_int, default=10_000,
                        help="simulated workers heartbeating (default 10,000)")
    parser.add_argument("--hz", type=positive_number, default=4.0,
                        help="heartbeats per worker per second")
    parser.add_argument("--seconds", type=positive_seconds, default=20.0, help="measured window")
    parser.add_argument("--publishers", type=positive_int, default=2, help="publisher processes")
    parser.add_argument("--signed", action="store_true",
                        help="sign heartbeats and make the router verify them")
    parser.add_argument("--legacy-agents", action="store_true",
                        help="publish as agents did before load records (every heartbeat "
                        "a message on the routers' channel), to compare")
    parser.add_argument("--tap-watched", action="store_true",
                        help="someone subscribes to the tap channel: agents publish every "
                        "heartbeat there too (by default, as with nobody watching, once every "
                        "10 s)")
    parser.add_argument("--router-processes", type=positive_int, default=1,
                        help="the router's --processes (default 1): its CPU is the whole "
                        "process tree's (the first process reads the fleet, the others "
                        "mirror it: router.registry.mirror)")
    parser.add_argument("--busy-agents", action="store_true",
                        help="every load record with a new running count, as a busy "
                        "fleet's (by default the load of each worker stays the same)")
    parser.add_argument("--compiled", action="store_true",
                        help="run the router from the compiled copy of this checkout that "
                        "bench-proxy measures (`globalpool compile`; built first if needed, "
                        "1-3 min): the build to deploy")
    parser.add_argument("--fleet-view-cpu-share", type=fraction,
                        default=DEFAULT_FLEET_VIEW_CPU_SHARE,
                        help="the router's router.fleet_view_cpu_share (default "
                        f"{DEFAULT_FLEET_VIEW_CPU_SHARE:g}, as regions.yaml's): more reads the "
                        "records more often")


def run_bench_heartbeats(args: argparse.Namespace) -> int:
    from lab.benchproxy.heartbeats import main

    return asyncio.run(main(workers=args.workers, hz=args.hz, seconds=args.seconds,
                            publishers=args.publishers, signed=args.signed, out=args.out,
                            legacy=args.legacy_agents, cpu_share=args.fleet_view_cpu_share,
                            tap_watched=args.tap_watched, processes=args.router_processes,
                            busy=args.busy_agents, compiled=args.compiled))


def add_bench_instructions_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=None,
                        help="write instructions.json and callgrind's dumps here")
    parser.add_argument("--tree", type=Path, action="append", default=None,
                        help="a source tree (checkout) whose router to measure; repeat to "
                             "compare (default: this one)")
    parser.add_argument("--workloads", default="unary,stream",
                        help="comma-separated: unary,stream,paced (default unary,stream)")
    parser.add_argument("--requests", type=positive_int, default=1000,
                        help="measured requests per workload (default 1,000)")
    parser.add_argument("--vllm-router", action="store_true",
                        help="also measure vllm-router (installed as bench-proxy installs it)")
    parser.add_argument("--peers-dir", type=Path, default=None,
                        help="virtualenv for vllm-router (default: "
                             "~/.cache/globalpool/bench-peers)")


def run_bench_instructions(args: argparse.Namespace) -> int:
    from lab.benchproxy.instructions import Options, bench_instructions
    from lab.benchproxy.workloads import workloads

    names = _names(args.workloads) or []
    known = [w.name for w in workloads(False)]
    wrong = [n for n in names if n not in known]
    if wrong or not names:
        print(f"unknown workload(s) {', '.join(wrong)} (known: {', '.join(known)})")
        return 2
    here = Path(__file__).resolve().parents[2]
    trees = [tree.resolve() for tree in (args.tree or [here])]
    missing = [str(tree) for tree in trees if not (tree / "router" / "cli.py").is_file()]
    if missing:
        print(f"not a globalpool source tree: {', '.join(missing)}")
        return 2
    options = Options(out=args.out, trees=trees, workloads=names,
                      requests=args.requests, vllm_router=args.vllm_router,
                      peers_dir=args.peers_dir)
    document = _run_unless_unavailable("bench-instructions", bench_instructions(options))
    if document is None:
        return 2
    return 0 if all(row["errors"] == 0 for row in document["results"]) else 1


def _run_unless_unavailable(command: str, bench: Coroutine[Any, Any, dict[str, Any]]
                            ) -> dict[str, Any] | None:
    """`bench` run to its end on a new event loop; None (said why) if it was Unavailable."""
    from lab.benchproxy.unavailable import Unavailable
    from router.event_loop import new_event_loop

    loop = new_event_loop()
    try:
        return loop.run_until_complete(bench)
    except Unavailable as exc:
        print(f"{command}: {exc}")
        return None
    finally:
        loop.close()
