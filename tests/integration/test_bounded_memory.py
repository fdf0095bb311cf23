"""`globalpool bench-memory` on real processes: https workers through one TLS context to a
real TLS server on loopback, and (slow tier) a router fed new header lines."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, skip_unless_slow_tests_are_asked_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _bench_memory(out: Path, *args: str) -> list[dict[str, Any]]:
    if shutil.which("openssl") is None:
        pytest.skip("the https part needs the openssl command (apt-get install openssl)")
    done = subprocess.run(
        [sys.executable, "-m", "router.cli", "bench-memory", "--out", str(out), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows: list[dict[str, Any]] = json.loads((out / "memory.json").read_text())["results"]
    return rows


def test_https_workers_share_one_verifying_context_over_real_tls(tmp_path: Path) -> None:
    (row,) = _bench_memory(tmp_path, "--parts", "https", "--https-endpoints", "400")
    assert row["targets"] == 400 and not row["stopped_at_limit"]
    assert row["tls_contexts"] == 1
    # every request verified the server's certificate for 127.0.0.1 and was answered
    assert (row["answered"], row["errors"]) == (400, 0), row["error_samples"]
    # pooled per (host, port): never more connections to a port than clients at once
    assert HTTPS_PORTS <= row["connections"]["opened"] <= 32 * HTTPS_PORTS < 400


HTTPS_PORTS = 4


def test_a_router_fed_new_header_lines_answers_every_request(
        request: pytest.FixtureRequest, tmp_path: Path) -> None:
    skip_unless_slow_tests_are_asked_for(request.config, "starts Valkey and a router (~20 s)")
    headers, https = _bench_memory(tmp_path, "--requests", "5000", "--https-endpoints", "200")
    assert headers["errors"] == 0
    samples = headers["samples"]
    assert [s["requests_sent"] for s in samples] == [2000 + 500 * n for n in range(11)]
    assert all(s["rss_mib"] > 10 for s in samples)
    assert https["tls_contexts"] == 1 and https["answered"] == 200
