"""Child processes of a benchmark: pinned to cores, started with known PIDs, stopped by PID."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

from lab.devstack.process import die_with_parent


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on `host`."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def usable_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def pinning(cores: set[int] | None) -> Callable[[], None]:
    """A preexec_fn: pin the child to `cores` (None: leave it) and tie it to our life."""

    def preexec() -> None:
        die_with_parent()
        if cores:
            os.sched_setaffinity(0, cores)

    return preexec


def start(args: Sequence[str], *, cores: set[int] | None, log_path: Path,
          env: dict[str, str] | None = None, cwd: Path | None = None,
          stdout_pipe: bool = False) -> subprocess.Popen[bytes]:
    """Start `args` pinned to `cores`, stderr (and stdout unless piped) to `log_path`."""
    log = open(log_path, "ab")  # noqa: SIM115 - the child holds it; closed when we stop
    try:
        return subprocess.Popen(
            list(args), stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if stdout_pipe else log, stderr=log,
            env=env, cwd=cwd, preexec_fn=pinning(cores),
        )
    finally:
        log.close()


def stop(process: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after `timeout_s`; always reaped. Only this PID is signalled."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            process.wait()
    if process.stdout is not None:
        process.stdout.close()


def stop_tree(process: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    """`stop(process)`, then SIGKILL whichever of its descendants (as they were just before
    the stop) outlived it: a supervisor killed after `timeout_s` leaves its children to
    init. Only PIDs that are still the same processes (same start time) are signalled."""
    from lab.benchproxy.cpu import live_descendants, start_ticks

    before = live_descendants(process.pid) if process.poll() is None else []
    stop(process, timeout_s)
    for pid, started in before:
        if start_ticks(pid) == started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def log_tail(path: Path, limit: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-limit:].strip()
    except OSError:
        return ""


_SPIN = ("import time\nstart = time.perf_counter(); cpu = time.process_time()\n"
         "while time.perf_counter() - start < {s}: pass\n"
         "print((time.process_time() - cpu) / (time.perf_counter() - start))")


def core_share(cores: set[int] | None, seconds: float = 1.0) -> float | None:
    """The share of a core a busy process pinned to `cores` gets right now (1.0: all of
    it). Other work on a shared machine lowers it; every figure measured meanwhile is
    then slower, and its CPU time per request somewhat higher (cache and switches)."""
    import sys

    try:
        done = subprocess.run([sys.executable, "-c", _SPIN.format(s=seconds)],
                              capture_output=True, text=True, timeout=seconds + 30,
                              preexec_fn=pinning(cores))
        return float(done.stdout.strip())
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
