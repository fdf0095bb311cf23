"""`globalpool bench-instructions`: the router's instructions per request under callgrind,
the same from one run of a tree to the next (why it exists: CPU time is not, here)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, skip_for_missing_tool, skip_unless_slow_tests_are_asked_for

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]


def test_one_tree_measured_twice_counts_the_same_instructions(
        request: pytest.FixtureRequest, tmp_path: Path) -> None:
    skip_unless_slow_tests_are_asked_for(request.config, "runs the router under valgrind (~30 s)")
    if shutil.which("valgrind") is None:
        skip_for_missing_tool("valgrind is not installed (apt-get install valgrind)")
    out = tmp_path / "instructions"
    done = subprocess.run(
        [sys.executable, "-m", "router.cli", "bench-instructions", "--out", str(out),
         "--workloads", "unary,stream", "--requests", "300", "--tree", str(ROOT),
         "--tree", str(ROOT)],
        cwd=ROOT, capture_output=True, text=True, timeout=540,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads((out / "instructions.json").read_text())["results"]
    assert [(r["workload"], r["errors"], r["requests"]) for r in rows] == [
        ("unary", 0, 300), ("stream", 0, 300)] * 2
    first, second = rows[:2], rows[2:]
    for a, b in zip(first, second, strict=True):
        # a proxied request is tens to hundreds of thousands of instructions
        assert 20_000 < a["instructions_per_request"] < 5_000_000, a
        assert abs(a["instructions_per_request"] / b["instructions_per_request"] - 1) < 0.05
    assert rows[1]["instructions_per_request"] > rows[0]["instructions_per_request"]
    assert "| x first |" in done.stdout and "1.0" in done.stdout


def test_a_directory_that_is_no_source_tree_is_refused(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "router.cli", "bench-instructions", "--tree", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 2
    assert f"not a globalpool source tree: {tmp_path.resolve()}" in done.stdout


def test_vllm_router_is_measured_beside_the_tree(request: pytest.FixtureRequest,
                                                 tmp_path: Path) -> None:
    skip_unless_slow_tests_are_asked_for(request.config, "runs two routers under valgrind (~40 s)")
    if shutil.which("valgrind") is None:
        skip_for_missing_tool("valgrind is not installed (apt-get install valgrind)")
    peers = Path.home() / ".cache" / "globalpool" / "bench-peers"
    if not (peers / "bin" / "vllm-router").exists():
        pytest.skip("vllm-router is not installed yet (globalpool bench-proxy installs it)")
    out = tmp_path / "instructions"
    done = subprocess.run(
        [sys.executable, "-m", "router.cli", "bench-instructions", "--out", str(out),
         "--workloads", "unary", "--requests", "200", "--vllm-router"],
        cwd=ROOT, capture_output=True, text=True, timeout=540,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads((out / "instructions.json").read_text())["results"]
    assert [r["router"].split()[0] for r in rows] == [str(ROOT.resolve()), "vllm-router"]
    assert all(r["errors"] == 0 and r["requests"] == 200 for r in rows), rows
    assert all(20_000 < r["instructions_per_request"] < 5_000_000 for r in rows), rows
