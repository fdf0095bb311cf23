"""An idle router process costs next to nothing: its watches sleep while no request waits
(router.health.tracker, router.registry.peers), and it does not wake 100 times a second
for them. Counted on a real `globalpool router` process, with the kernel's own count of
the times it blocked and was woken (`voluntary_ctxt_switches`), not with a clock."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import yaml

from lab.devstack.valkey import free_port
from tests.conftest import ROOT

# Measured here: 110 a second before the watches slept (loop lag 50, stall watch 20,
# peer exchange 20, the rest: the fleet view's reads, drains, the batch runner, Redis),
# ~36 after.
MAX_WAKEUPS_PER_S = 60
WINDOW_S = 5.0


def _wakeups(pid: int) -> int:
    """Times any thread of `pid` blocked and was woken, so far."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                total += int(line.split()[1])
    return total


def test_an_idle_router_wakes_rarely(tmp_path: Path, redis_url: str) -> None:
    port = free_port()
    config = tmp_path / "regions.yaml"
    config.write_text(yaml.safe_dump({
        "apiVersion": "globalpool/v1",
        "redis": {"url": redis_url, "key_prefix": f"gptest-{uuid.uuid4().hex[:10]}"},
        "router": {"region": "us-east", "port": port},
        "regions": {"us-east": {"models": ["m"]}},
    }))
    log = tmp_path / "router.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GLOBALPOOL_")}
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "router.cli", "router", "--config", str(config),
             "--processes", "1"],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + 20
        while b"router listening on" not in log.read_bytes():
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        time.sleep(1.0)  # past its start-up
        before, started = _wakeups(process.pid), time.monotonic()
        time.sleep(WINDOW_S)
        rate = (_wakeups(process.pid) - before) / (time.monotonic() - started)
        assert rate < MAX_WAKEUPS_PER_S, f"{rate:.0f} wake-ups a second while idle"
        assert process.poll() is None, log.read_text()
    finally:
        process.terminate()
        process.wait(10)
