"""`globalpool drill hostile`: its own flags (it is dispatched before the other drills'
scenario choices are parsed), and running it."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import get_args

from lab.sim.faults import Misbehaviour

EXIT_GOALS_NOT_MET = 3


def build_parser() -> argparse.ArgumentParser:
    from lab.drill.hostile.run import CLIENT_BEHAVIOURS, WORKER_FAULTS

    parser = argparse.ArgumentParser(
        prog="globalpool drill hostile",
        description="Worker faults x client behaviours, on real processes on loopback: "
        "report.json, report.md and matrix.png in --out (DRILLS.md).")
    parser.add_argument("--out", required=True, type=Path,
                        help="folder for the report, requests.jsonl and the lanes' logs")
    parser.add_argument("--quick", action="store_true",
                        help="each fault with a normal client and each behaviour against the "
                        "first fault, instead of every pair (minutes fewer)")
    parser.add_argument("--faults", default=",".join(WORKER_FAULTS),
                        help="worker faults, comma-separated (default: %(default)s; also "
                        "short_content_length); `wedge` is an engine that takes requests in "
                        "and runs no step, the others ways of answering wrongly")
    parser.add_argument("--clients", default=",".join(CLIENT_BEHAVIOURS),
                        help="client behaviours, comma-separated (default: %(default)s)")
    parser.add_argument("--lanes", type=int, default=2,
                        help="topologies running cells side by side (default %(default)s)")
    parser.add_argument("--healthy-workers", type=int, default=3,
                        help="healthy simulated workers beside the bad one (default %(default)s)")
    parser.add_argument("--idle-connections", type=int, default=10_000,
                        help="idle_connections: how many (default %(default)s)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="PATH=VALUE",
                        help="change one setting of the lanes' regions.yaml, e.g. "
                        "router.timeouts.first_byte_s=5 (repeatable)")
    parser.add_argument("--log-level", default="WARNING",
                        help="DEBUG, INFO, WARNING or ERROR (default %(default)s)")
    return parser


def _names(raw: str, known: Sequence[str], flag: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in raw.split(",") if name.strip())
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise ValueError(f"{flag}: unknown {', '.join(unknown) or '(none given)'}; "
                         f"known: {', '.join(known)}")
    return names


def main(argv: Sequence[str]) -> int:
    """Exit 0 when the drill ran and every cell met its goals, 3 when a goal was missed,
    1 when the topology failed, 2 on bad flags."""
    from lab.devstack.children import StackError
    from lab.drill.hostile.behaviours import BEHAVIOURS
    from lab.drill.hostile.cell import CellSettings
    from lab.drill.hostile.clients import ClientSettings
    from lab.drill.hostile.lane import WEDGE
    from lab.drill.hostile.run import HostileOptions, run_hostile
    from lab.drill.run import command_line
    from router.event_loop import new_event_loop

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    faults_known = [*(mode for mode in get_args(Misbehaviour) if mode != "none"), WEDGE]
    try:
        faults = _names(args.faults, faults_known, "--faults")
        clients = _names(args.clients, list(BEHAVIOURS), "--clients")
        if args.lanes < 1 or args.healthy_workers < 1 or args.idle_connections < 0:
            raise ValueError("--lanes and --healthy-workers must be >= 1, "
                             "--idle-connections >= 0")
    except ValueError as exc:
        print(f"globalpool drill hostile: {exc}", file=sys.stderr)
        return 2
    options = HostileOptions(
        out=args.out, faults=faults, clients=clients, quick=args.quick, lanes=args.lanes,
        healthy_workers=args.healthy_workers, cell=CellSettings(),
        client_settings=ClientSettings(idle_connections=args.idle_connections),
        overrides=tuple(args.overrides), command=command_line())

    def say(line: str) -> None:
        print(line, flush=True)

    loop = new_event_loop()
    try:
        report = loop.run_until_complete(run_hostile(options, say))
    except (StackError, ValueError, OSError) as exc:
        kept = args.out / "report.md"
        print(f"globalpool drill hostile failed: {exc}"
              + (f"\nthe cells that ran: {kept}" if kept.exists() else ""),
              file=sys.stderr, flush=True)
        return 1
    finally:
        loop.close()
    for goal in report["goals"]:
        say(f"goal {'met   ' if goal['met'] else 'MISSED'} {goal['goal']} "
            f"({len(goal['cells_missed'])} of {len(report['cells'])} cells missed it)")
    say(json.dumps({"cells": len(report["cells"]), "cells_met": report["cells_met"],
                    "wall_s": report["wall_s"]}))
    say(f"report: {args.out / 'report.md'}  matrix: {args.out / 'matrix.png'}")
    return 0 if report["goals_met"] else EXIT_GOALS_NOT_MET
