"""Run `globalpool up` as a user would (a real child process) and read what it started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lab.devstack.valkey import free_port
from tests.conftest import ROOT


@dataclass
class RunningUp:
    process: subprocess.Popen[bytes]
    state: dict[str, Any]
    stdout_path: Path

    @property
    def url(self) -> str:
        return str(self.state["router_url"])

    def children(self, role: str | None = None) -> list[dict[str, Any]]:
        return [c for c in self.state["children"] if role is None or c["role"] == role]

    def all_pids(self) -> list[int]:
        pids = [int(c["pid"]) for c in self.state["children"]]
        if self.state.get("redis_pid"):
            pids.append(int(self.state["redis_pid"]))
        return pids

    def output(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return int(self.process.returncode)


def small_config(tmp_path: Path, **overrides: Any) -> Path:
    """A three-region regions.yaml sized for fast tests; `overrides` replace top-level keys."""
    document: dict[str, Any] = {
        "apiVersion": "globalpool/v1",
        "redis": {"url": "embedded", "key_prefix": f"gp-{tmp_path.name[-12:]}"},
        "router": {"region": "us-east", "host": "127.0.0.1", "port": free_port(),
                   "timeouts": {"connect_s": 1, "first_byte_s": 10, "idle_s": 10,
                                "total_s": 60}},
        "heartbeat": {"interval_s": 0.2, "ttl_s": 1.0},
        "regions": {
            "us-east": {"rtt_ms": {"eu-west": 80, "ap-south": 190}, "models": ["tiny-llama"],
                        "simulated": {"workers": 2, "max_num_seqs": 4, "decode_step_ms": 5}},
            "eu-west": {"rtt_ms": {"ap-south": 120}, "models": ["tiny-llama", "tiny-coder"],
                        "simulated": {"workers": 2, "max_num_seqs": 4, "decode_step_ms": 5}},
            "ap-south": {"models": ["tiny-llama"],
                         "simulated": {"workers": 2, "max_num_seqs": 4, "decode_step_ms": 5}},
        },
    }
    document.update(overrides)
    path = tmp_path / "regions.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def start_up(tmp_path: Path, config_path: Path, timeout_s: float = 150.0) -> RunningUp:
    """`globalpool up --config ... --state-file ...`, waiting until the state file appears."""
    state_file = tmp_path / "up-state.json"
    stdout_path = tmp_path / "up-stdout.log"
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    with stdout_path.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "router.cli", "up", "--config", str(config_path),
             "--state-file", str(state_file), "--log-dir", str(tmp_path / "logs")],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
        )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if state_file.exists():
            try:
                state = json.loads(state_file.read_text())
            except ValueError:
                time.sleep(0.05)  # written but not complete yet
                continue
            return RunningUp(process, state, stdout_path)
        if process.poll() is not None:
            raise AssertionError(f"globalpool up exited {process.returncode}:\n"
                                 f"{stdout_path.read_text(errors='replace')}")
        time.sleep(0.1)
    process.kill()
    process.wait()
    raise AssertionError(f"globalpool up not ready in {timeout_s} s:\n"
                         f"{stdout_path.read_text(errors='replace')}")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still answers kill(0); it has exited for our purposes.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def drill_config(tmp_path: Path, **overrides: Any) -> Path:
    """Two regions for fast drills: us-east (2 engines, the router's) and eu-west (1).

    Short timeouts so that a blackholed request is retried within a drill's few seconds;
    `overrides` replace top-level keys.
    """
    simulated = {"max_num_seqs": 16, "decode_step_ms": 5, "prefill_tokens_per_s": 20000}
    document: dict[str, Any] = {
        "apiVersion": "globalpool/v1",
        "redis": {"url": "embedded", "key_prefix": "gp-drill"},
        "router": {"region": "us-east", "host": "127.0.0.1", "port": free_port(),
                   "timeouts": {"connect_s": 1, "first_byte_s": 2, "idle_s": 2,
                                "total_s": 30}},
        # As regions.yaml, a little faster: a probe may take ttl/3 before the engine is
        # reported degraded, which a busy CI machine needs.
        "heartbeat": {"interval_s": 0.25, "ttl_s": 2.0},
        "regions": {
            "us-east": {"rtt_ms": {"us-east": 1, "eu-west": 40}, "models": ["tiny-llama"],
                        "simulated": {"workers": 2, **simulated}},
            "eu-west": {"rtt_ms": {"eu-west": 1}, "models": ["tiny-llama"],
                        "simulated": {"workers": 1, **simulated}},
        },
    }
    document.update(overrides)
    path = tmp_path / "regions.yaml"
    path.write_text(yaml.safe_dump(document))
    return path
