"""`bench-proxy --throughput`'s wrk script against the real fake backend: wrk posts the
body the backend answers, and its done() line is read back."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from lab.benchproxy import procs
from lab.benchproxy.throughput import _run_wrk, wrk_script
from lab.benchproxy.workloads import workloads
from tests.conftest import skip_for_missing_tool

pytestmark = pytest.mark.integration


@pytest.mark.timeout(40)
def test_wrk_posts_chat_completions_to_the_fake_backend(tmp_path: Path) -> None:
    if shutil.which("wrk") is None:
        skip_for_missing_tool("wrk is not installed (Debian: apt-get install wrk)")
    port = procs.free_port()
    backend = procs.start([sys.executable, "-m", "lab.benchproxy.backend", "--port", str(port)],
                          cores=None, log_path=tmp_path / "backend.log", stdout_pipe=True)
    try:
        assert backend.stdout is not None and backend.stdout.readline().strip() == b"ready"
        script = tmp_path / "post.lua"
        body = next(w for w in workloads(True) if w.name == "unary").body()
        script.write_text(wrk_script(body))
        wrk = shutil.which("wrk")
        assert wrk is not None
        result, wrk_cpu_s = _run_wrk(wrk, f"http://127.0.0.1:{port}/v1/chat/completions",
                                     script, 1.0, 4, None, tmp_path / "wrk.log")
    finally:
        procs.stop(backend)
    assert result.failed == 0, (tmp_path / "wrk.log").read_text()
    assert result.ok > 100 and result.duration_s == pytest.approx(1.0, abs=0.5)
    assert result.requests_per_s_printed == pytest.approx(result.requests_per_s, rel=0.05)
    assert 0 < result.latency_ms["p50"] <= result.latency_ms["p99"] <= result.latency_ms["max"]
    assert wrk_cpu_s > 0
