"""Every `globalpool` command's --help, from the parsers the command itself builds: each
option and argument says what it is, and no text names an issue number (a reference to
the project's tracker means nothing to the person reading --help)."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator

import pytest

from lab.drill.hostile.cli import build_parser as build_hostile_parser
from router.cli import build_parser

ISSUE_NUMBER = re.compile(r"issue\s*#?\d", re.IGNORECASE)


def _commands(parser: argparse.ArgumentParser, name: str,
              ) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """`parser` and, depth first, every subcommand's parser, by command line."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command, subparser in action.choices.items():
                yield from _commands(subparser, f"{name} {command}")


# `drill hostile` is dispatched before the main parser runs, to a parser of its own.
COMMANDS = dict([*_commands(build_parser(), "globalpool"),
                 ("globalpool drill hostile", build_hostile_parser())])


def test_the_walk_reaches_every_kind_of_subcommand() -> None:
    expected = {"up", "router", "worker", "sim", "check-config", "status", "drill",
                "drill hostile", "bench", "bench-proxy", "bench-memory", "compile"}
    assert {f"globalpool {command}" for command in expected} <= set(COMMANDS)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_option_has_help(command: str) -> None:
    missing = ["/".join(action.option_strings) or action.dest
               for action in COMMANDS[command]._actions
               if not isinstance(action, argparse._SubParsersAction)
               and not (action.help and action.help.strip())]
    assert not missing, f"`{command} --help`: no help text for {', '.join(missing)}"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_names_no_issue_number(command: str) -> None:
    text = COMMANDS[command].format_help()
    found = [" ".join(text[max(0, match.start() - 40):match.end()].split())
             for match in ISSUE_NUMBER.finditer(text)]
    assert not found, f"`{command} --help` names an issue: {found}"
