"""The `globalpool` subcommands that run the lab (`lab/`: the simulator, `up`, the
benchmarks and the drills), and the one place where the runtime reaches into it.

The lab is imported lazily, inside the subcommand that needs it, so that a runtime install
(without the `lab` extra) still runs `router`, `worker`, `status` and the rest, and a lab
subcommand there says in one line how to get the lab instead of failing halfway. The
import-linter contract that keeps `router` from importing `lab` makes this module its one
exception (pyproject.toml).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from router.config import GlobalConfig

LAB_INSTALL = "pip install 'globalpool[lab]'"

Configure = Callable[[argparse.ArgumentParser], None]


def lab_available() -> bool:
    """Whether the lab and the `lab` extra's dependencies are importable here."""
    try:
        import lab  # noqa: F401  (raises when an extra's dependency is missing)
    except ModuleNotFoundError:
        return False
    return True


def missing_lab_message(command: str) -> str:
    """The one line a lab subcommand prints where the lab is not installed."""
    return f"globalpool {command} needs the lab: {LAB_INSTALL}"


def add_lab_command(commands: argparse._SubParsersAction[argparse.ArgumentParser], name: str,
                    help_text: str, *, with_lab: bool,
                    add_arguments: Configure | None = None) -> None:
    """Subcommand `name` with its flags from the lab (`lab.commands.SUBCOMMANDS`) or from
    `add_arguments`; without the lab, one that takes any arguments (the caller parses
    known arguments only) and sets `lab_command`, so that the caller prints
    `missing_lab_message` and exits 2."""
    if not with_lab:
        stub = commands.add_parser(name, help=help_text, add_help=False)
        stub.set_defaults(lab_command=name)
        return
    parser = commands.add_parser(name, help=help_text)
    if add_arguments is not None:
        add_arguments(parser)
        return
    from lab.commands import SUBCOMMANDS

    add_lab_arguments, run = SUBCOMMANDS[name]
    add_lab_arguments(parser)
    parser.set_defaults(run=run)


def hostile_drill(arguments: Sequence[str]) -> int | None:
    """`globalpool drill hostile ...` run by the hostile drill's own parser (its exit
    code); None for any other command line."""
    from lab.drill.cli import hostile_argv

    hostile = hostile_argv(arguments)
    if hostile is None:
        return None
    from lab.drill.hostile.cli import main as run_hostile

    return run_hostile(hostile)


def run_up(args: argparse.Namespace, config: GlobalConfig) -> int:
    """`globalpool up` with a checked config: the local stack until interrupted."""
    from lab.devstack.up import run_up as run_stack

    return run_stack(args, config)
