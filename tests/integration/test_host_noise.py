"""A CPU hog beside the router must not teach it that its own region is slow.

`globalpool up` as a user runs it (two regions behind one router: us-east local with two
4-slot simulated engines, eu-west 80 ms away), and next to it processes that spin on both
cores for a bounded time. The router reads first bytes late while it is starved; that is
its own delay, not the region's: every request must stay local while local workers have
free slots, and us-east's latency penalty must stay 0.
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from tests.conftest import CPU_HOG
from tests.integration.stack import RunningUp, pid_alive, small_config, start_up

pytestmark = pytest.mark.integration

HOG_S = 25.0  # each hog process ends itself after this long
REQUESTS = 36
CONCURRENCY = 3  # well under us-east's 8 batch slots


@pytest.fixture
def up(tmp_path: Path) -> Iterator[RunningUp]:
    regions = {
        "us-east": {"rtt_ms": {"eu-west": 80}, "models": ["tiny-llama"],
                    "simulated": {"workers": 2, "max_num_seqs": 4, "decode_step_ms": 15}},
        "eu-west": {"models": ["tiny-llama"],
                    "simulated": {"workers": 2, "max_num_seqs": 8, "decode_step_ms": 15}},
    }
    running = start_up(tmp_path, small_config(tmp_path, regions=regions))
    try:
        yield running
    finally:
        running.stop()
        assert [pid for pid in running.all_pids() if pid_alive(pid)] == []


def _stream(url: str, index: int) -> tuple[str, str, float]:
    """One streamed chat request: (route, region, client TTFT in s)."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
    started = time.monotonic()
    with client.chat.completions.with_streaming_response.create(
            model="tiny-llama", stream=True, max_tokens=12,
            messages=[{"role": "user", "content": f"question {index}: " + "words " * 40}],
    ) as answer:
        ttft_s = -1.0
        for _ in answer.iter_lines():
            if ttft_s < 0:
                ttft_s = time.monotonic() - started
        return (answer.headers["x-globalpool-route"], answer.headers["x-globalpool-region"],
                ttft_s)


def _penalty(url: str, region: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    for line in text.splitlines():
        if line.startswith(f'globalpool_region_latency_penalty_ms{{region="{region}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_cpu_hog_beside_the_router_sends_nothing_away(up: RunningUp) -> None:
    for index in range(6):  # warm up: the engines report their figures
        _stream(up.url, index)
    hogs = [subprocess.Popen([sys.executable, "-c", CPU_HOG.format(s=HOG_S)]) for _ in range(3)]
    try:
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            results = list(pool.map(lambda i: _stream(up.url, i), range(REQUESTS)))
        penalty_ms = _penalty(up.url, "us-east")
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    routes = Counter(route for route, _, _ in results)
    ttfts = sorted(ttft for _, _, ttft in results)
    print(f"routes under the hog: {dict(routes)}; client TTFT p50 {ttfts[len(ttfts) // 2]:.3f}"
          f" s, max {ttfts[-1]:.3f} s; us-east penalty {penalty_ms} ms")
    assert routes == {"local": REQUESTS}, results
    assert penalty_ms == 0.0
