"""Child processes of the local stack: spawned with a known PID, logged, stopped in order.

A child prints one line on stdout when it is ready (`sim listening on URL`, `worker ...`,
`router listening on URL`, `netem listening on URL ports=...`); the launcher waits for
it, then copies the rest of stdout to the child's log next to its stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from lab.devstack.process import die_with_parent


class StackError(RuntimeError):
    """A part of the local stack did not start; the message says which and where its log is."""


@dataclass
class Child:
    """One running process of the stack.

    `args` are the arguments after `python -m MODULE`, kept so that the same process can
    be started again (`restart`); `url` is where it serves (a sim, a router, a netem
    control API) or, for a worker agent, the engine it watches; `advertise_url` is where
    routers reach a sim (its netem port, or the sim itself).
    """

    name: str
    role: str  # "sim" | "worker" | "router" | "netem"
    region: str | None
    process: asyncio.subprocess.Process
    log_path: Path
    module: str
    args: list[str]
    ready_prefix: str
    env: Mapping[str, str] | None = None
    url: str | None = None
    advertise_url: str | None = None
    ready_line: str = ""
    starts: int = 1
    _log: IO[bytes] | None = field(default=None, repr=False)
    _drain: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def running(self) -> bool:
        return self.process.returncode is None


async def spawn(
    *, name: str, role: str, region: str | None, module: str, args: Sequence[str],
    ready_prefix: str, log_path: Path, python: str, timeout_s: float,
    env: Mapping[str, str] | None = None, starts: int = 1,
) -> Child:
    """Start `python -m module args...` and wait for its ready line (StackError if none)."""
    log = log_path.open("wb" if starts == 1 else "ab")  # a restart continues the log
    process = await asyncio.create_subprocess_exec(
        python, "-m", module, *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=log,
        env=None if env is None else dict(env),
        preexec_fn=die_with_parent,
    )
    child = Child(name=name, role=role, region=region, process=process, log_path=log_path,
                  module=module, args=list(args), ready_prefix=ready_prefix, env=env,
                  starts=starts, _log=log)
    try:
        child.ready_line = await _read_ready_line(child, timeout_s)
    except BaseException:
        await terminate(child, 2.0)
        await close(child)
        raise
    words = child.ready_line.split()
    child.url = next((w for w in words if w.startswith("http://")), None)
    child._drain = asyncio.create_task(_copy_stdout(child))
    return child


async def _read_ready_line(child: Child, timeout_s: float) -> str:
    assert child.process.stdout is not None
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise StackError(f"{child.name} did not start in {timeout_s:g} s; "
                             f"see {child.log_path}")
        try:
            async with asyncio.timeout(remaining):
                raw = await child.process.stdout.readline()
        except TimeoutError:
            continue
        if not raw:
            await child.process.wait()
            raise StackError(f"{child.name} exited with {child.process.returncode} while "
                             f"starting; see {child.log_path}:\n{tail(child.log_path)}")
        text = raw.decode(errors="replace").strip()
        if text.startswith(child.ready_prefix):
            return text


async def _copy_stdout(child: Child) -> None:
    assert child.process.stdout is not None and child._log is not None
    while line := await child.process.stdout.readline():
        child._log.write(line)
        child._log.flush()


async def terminate(child: Child, timeout_s: float) -> bool:
    """SIGTERM, then SIGKILL after `timeout_s`; reaps the process. False when it took
    the SIGKILL (SIGTERM did not stop it in time)."""
    if child.process.returncode is not None:
        return True
    with contextlib.suppress(ProcessLookupError):
        child.process.send_signal(signal.SIGTERM)
    try:
        async with asyncio.timeout(timeout_s):
            await child.process.wait()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            child.process.kill()
        await child.process.wait()
        return False
    return True


async def close(child: Child) -> None:
    """Stop copying its output and close its log (after the process has exited)."""
    if child._drain is not None:
        if child.running:
            child._drain.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await child._drain
        child._drain = None
    if child._log is not None:
        child._log.close()
        child._log = None


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
