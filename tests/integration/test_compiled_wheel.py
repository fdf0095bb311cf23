"""README's production install, `GLOBALPOOL_COMPILE=1 pip install .`: pip builds a wheel in
an isolated environment (setuptools and mypy only), with every module setup.py lists
compiled; and an editable build with the variable set is refused (its extensions would
shadow edited sources). The test suite itself runs on the compiled build in CI's compiled
tier; this checks the packaging. CI builds that wheel once (`.ci/run`): the compiled tier
runs on its extensions (`globalpool compile --wheel`), and GLOBALPOOL_COMPILED_WHEEL names
it here, where it is inspected rather than built again (~3 min), once shown to be built
from this checkout's sources."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from router.compiled import checkout_files, sync_copy, wheel_sources_differ
from tests.conftest import ROOT, skip_unless_slow_tests_are_asked_for

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(autouse=True)
def _only_when_slow_tests_are_asked_for(request: pytest.FixtureRequest) -> None:
    skip_unless_slow_tests_are_asked_for(request.config, "builds the compiled wheel (~2 min)")


def _compiled_modules() -> list[str]:
    """COMPILED_MODULES, read from setup.py as written (not imported: it runs setup())."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id == "COMPILED_MODULES"):
            return list(ast.literal_eval(node.value))
    raise AssertionError("setup.py has no COMPILED_MODULES")


def _copy_checkout(into: Path) -> Path:
    into.mkdir(parents=True)
    sync_copy(ROOT, into, checkout_files(ROOT))
    return into


def _compiled_wheel(tmp_path: Path) -> Path:
    """The wheel `GLOBALPOOL_COMPILE=1 pip wheel .` builds from this checkout: the one CI
    built (GLOBALPOOL_COMPILED_WHEEL), or built here."""
    given = os.environ.get("GLOBALPOOL_COMPILED_WHEEL")
    if given:
        wheel = Path(given)
        differ = wheel_sources_differ(wheel, ROOT)
        assert not differ, f"{wheel} was not built from this checkout: {differ[:5]}"
        return wheel
    source = _copy_checkout(tmp_path / "src")
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", ".", "-w",
         str(tmp_path / "dist")], cwd=source, capture_output=True, text=True,
        env={**os.environ, "GLOBALPOOL_COMPILE": "1"}, timeout=840, check=False)
    assert built.returncode == 0, built.stderr[-3000:]
    [wheel] = (tmp_path / "dist").glob("globalpool-*.whl")
    return wheel


def test_the_compiled_wheel_holds_an_extension_for_every_listed_module(
        tmp_path: Path) -> None:
    wheel = _compiled_wheel(tmp_path)
    assert "-cp3" in wheel.name and "none-any" not in wheel.name  # platform-specific
    names = zipfile.ZipFile(wheel).namelist()
    for module in _compiled_modules():
        stem = module.removesuffix(".py")
        extensions = [n for n in names if n.startswith(f"{stem}.") and n.endswith(".so")]
        assert extensions, f"{module} is not compiled in {wheel.name}"
        assert module in names  # the source ships beside it
    # mypyc's shared runtime, at the top level
    assert any("__mypyc" in n and "/" not in n and n.endswith(".so") for n in names)


def test_an_editable_compiled_build_is_refused(tmp_path: Path) -> None:
    source = _copy_checkout(tmp_path / "src")
    hook = ("from setuptools import build_meta; "
            f"build_meta.build_editable({str(tmp_path / 'out')!r})")
    refused = subprocess.run([sys.executable, "-c", hook], cwd=source, capture_output=True,
                             text=True, env={**os.environ, "GLOBALPOOL_COMPILE": "1"},
                             timeout=300, check=False)
    assert refused.returncode != 0
    assert "the compiled build is not editable" in refused.stdout + refused.stderr
    assert not list(source.rglob("*.so"))
