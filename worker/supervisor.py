"""Launch vLLM as a child process, keep it running, and stop it without leaving anything behind.

`EngineSupervisor.run()` starts the engine command in a process group of its own, waits for
its /health to answer (at most `start_timeout_s`), and then watches the process. An engine
that exits, or that does not become healthy in time, is restarted after a backoff that
doubles with each consecutive failure up to `max_backoff_s`; an engine that never became
healthy `max_failed_starts` times in a row is given up on (`EngineGaveUpError`): that is a
broken command or model, not a crash that a restart mends.

`stop()` sends SIGTERM to the whole process group (vLLM runs an engine-core process and
workers beside its API server), waits `stop_timeout_s`, then sends SIGKILL. Each child also
gets PR_SET_PDEATHSIG, so a supervisor killed with SIGKILL still takes its engine with it.

No threads of its own: the engine is an asyncio subprocess, health checks go over the
caller's aiohttp session, and the clock and sleep are injectable for tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import functools
import logging
import os
import shlex
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import IO

import aiohttp

log = logging.getLogger(__name__)

HealthCheck = Callable[[], Awaitable[bool]]

_PR_SET_PDEATHSIG = 1


class EngineGaveUpError(RuntimeError):
    """The engine never became healthy `max_failed_starts` times in a row."""


class ProcessState(StrEnum):
    """The engine process as the supervisor sees it."""

    LAUNCHING = "launching"  # started, /health not answering yet
    HEALTHY = "healthy"  # /health answered since this launch
    DOWN = "down"  # exited or missed its start deadline; a restart is pending
    STOPPED = "stopped"  # not running and not coming back (stopped, or given up)


@dataclass(frozen=True)
class EngineCommand:
    """The engine's command line, extra environment, and where its output goes.

    `log_path` None means the supervisor's own stderr (stdout too: a launcher may read the
    supervisor's stdout, which must stay free of engine output).
    """

    argv: tuple[str, ...]
    env: Mapping[str, str] | None = None
    log_path: Path | None = None
    niceness: int = 0  # see _start_engine_process

    def __str__(self) -> str:
        return shlex.join(self.argv)


@dataclass(frozen=True)
class RestartPolicy:
    """Deadlines and backoff, all in seconds.

    - `start_timeout_s`: launch -> /health answering; past it the engine is killed and
      counts as a failed start (big models load for minutes: the default is generous).
    - `initial_backoff_s` .. `max_backoff_s`: wait before restart n is
      min(max, initial * 2**(n-1)) over consecutive failures.
    - `stable_after_s`: an engine healthy this long resets the failure count.
    - `max_failed_starts`: give up after this many launches in a row that never became
      healthy; 0 never gives up.
    - `stop_timeout_s`: SIGTERM -> SIGKILL.
    """

    start_timeout_s: float = 600.0
    initial_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    stable_after_s: float = 60.0
    max_failed_starts: int = 5
    stop_timeout_s: float = 30.0
    health_poll_s: float = 0.5

    def backoff_s(self, failures: int) -> float:
        """Delay before the restart that follows `failures` (>= 1) consecutive failures."""
        return float(min(self.max_backoff_s,
                         self.initial_backoff_s * 2 ** min(max(failures, 1) - 1, 30)))


def http_health_check(session: aiohttp.ClientSession, url: str) -> HealthCheck:
    """True when GET `url` answers 200; any error or other status is False."""

    async def check() -> bool:
        try:
            async with session.get(url) as response:
                return response.status == 200
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False

    return check


def die_with_parent() -> None:
    """preexec_fn: the kernel sends SIGTERM to the child when its parent dies (Linux only).

    If the parent died between fork and prctl, the signal would never come: exit at once.
    """
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def _start_engine_process(niceness: int) -> None:
    """preexec_fn of the engine: its own session, die with the agent, run at `niceness`.

    The engine gets its own session (for the process-group kill), and with the kernel's
    autogroup scheduling (`/proc/sys/kernel/sched_autogroup_enabled`) every session is
    its own scheduling group: a plain `nice` would only order the engine's processes
    among themselves. The session's group is niced too, so the agent keeps its share.

    The session is made here, before the group is niced, not with `start_new_session`:
    uvloop (the agent's loop) runs preexec_fn *before* it calls setsid, so the write
    reniced the agent's own group (the agent, and everything started from the same
    shell or unit) and the engine then ran in a fresh group at nice 0: the opposite of
    what was asked (found on the real-vLLM tier: the test's processes and routers starved
    for up to 69 s, the engines at full weight).
    """
    os.setsid()
    die_with_parent()
    if niceness:
        os.nice(niceness)
        with contextlib.suppress(OSError), open("/proc/self/autogroup", "w") as autogroup:
            autogroup.write(str(niceness))


class EngineSupervisor:
    """Runs one engine until `stop()`. Call `run()` in a task; `state` says where it is."""

    def __init__(
        self,
        command: EngineCommand,
        policy: RestartPolicy,
        health: HealthCheck,
        *,
        on_change: Callable[[ProcessState], None] = lambda _state: None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        if not command.argv:
            raise ValueError("the engine command is empty")
        self._command = command
        self._policy = policy
        self._health = health
        self._on_change = on_change
        self._sleep = sleep
        self._monotonic = monotonic
        self._state = ProcessState.LAUNCHING
        self._process: asyncio.subprocess.Process | None = None
        self._stopping = False
        self._stop_requested = asyncio.Event()
        self._failures = 0
        self._failed_starts = 0
        self.launches = 0

    @property
    def state(self) -> ProcessState:
        return self._state

    @property
    def down(self) -> bool:
        """The engine is not running (a restart is pending, or none will come): heartbeats
        say `degraded` unless the worker is draining."""
        return self._state in (ProcessState.DOWN, ProcessState.STOPPED)

    @property
    def pid(self) -> int | None:
        """The running engine's PID (also its process group id), or None."""
        process = self._process
        return process.pid if process is not None and process.returncode is None else None

    async def run(self) -> None:
        """Launch and relaunch until `stop()`; returns then. Raises EngineGaveUpError.

        If the task is cancelled the engine is killed (SIGKILL to its group) on the way out.
        """
        try:
            while not self._stopping:
                process = await self._spawn()
                healthy_at = await self._until_healthy(process)
                if healthy_at is None and process.returncode is None and not self._stopping:
                    reason = f"did not answer /health within {self._policy.start_timeout_s:g} s"
                    log.error("engine (pid %d) %s; killing it", process.pid, reason)
                    await self._terminate(process, grace_s=min(5.0, self._policy.stop_timeout_s))
                else:
                    await process.wait()  # while stopping, stop() is ending it
                    reason = _describe_exit(process.returncode)
                await _end_group(process.pid)  # whatever the leader left behind
                if self._stopping:
                    break
                await self._after_failure(process.pid, reason, healthy_at)
        finally:
            process_left = self._process
            if process_left is not None and process_left.returncode is None:
                _kill_group(process_left.pid, signal.SIGKILL)
                await asyncio.shield(process_left.wait())
                await _end_group(process_left.pid)
            self._set_state(ProcessState.STOPPED)

    async def stop(self) -> int | None:
        """No more restarts; SIGTERM the engine's group, SIGKILL after `stop_timeout_s`.

        Returns the engine's exit code (None if none was running). Idempotent. The task
        running `run()` ends soon after; await it to be sure nothing is left.
        """
        self._stopping = True
        self._stop_requested.set()
        process = self._process
        if process is None or process.returncode is not None:
            return None if process is None else process.returncode
        return await self._terminate(process, grace_s=self._policy.stop_timeout_s)

    async def _spawn(self) -> asyncio.subprocess.Process:
        self._set_state(ProcessState.LAUNCHING)
        # fd 2: the supervisor's own stderr, for the engine's stdout too (see EngineCommand).
        output: IO[bytes] | int = 2
        if self._command.log_path is not None:
            output = self._command.log_path.open("ab")
        env = None if self._command.env is None else {**os.environ, **self._command.env}
        try:
            process = await asyncio.create_subprocess_exec(
                *self._command.argv,
                stdin=asyncio.subprocess.DEVNULL, stdout=output, stderr=output, env=env,
                preexec_fn=functools.partial(_start_engine_process, self._command.niceness),
            )
        except OSError as exc:
            raise EngineGaveUpError(f"cannot start the engine `{self._command}`: {exc}") from exc
        finally:
            if not isinstance(output, int):
                output.close()
        self._process = process
        self.launches += 1
        log.info("engine started (pid %d, launch %d): %s", process.pid, self.launches,
                 self._command)
        if self._stopping:  # stop() came while the process was being created
            await self._terminate(process, grace_s=self._policy.stop_timeout_s)
        return process

    async def _until_healthy(self, process: asyncio.subprocess.Process) -> float | None:
        """The time /health first answered, or None if the engine exited, missed its
        deadline, or a stop began first."""
        started = self._monotonic()
        exited = asyncio.ensure_future(process.wait())
        try:
            while not self._stopping and not exited.done():
                if await self._health():
                    now = self._monotonic()
                    log.info("engine healthy %.1f s after launch (pid %d)", now - started,
                             process.pid)
                    self._set_state(ProcessState.HEALTHY)
                    return now
                if self._monotonic() - started >= self._policy.start_timeout_s:
                    return None
                await asyncio.wait((exited,), timeout=self._policy.health_poll_s)
            return None
        finally:
            exited.cancel()
            # gather, not `await exited`: a cancellation of this task must not be swallowed.
            await asyncio.gather(exited, return_exceptions=True)

    async def _after_failure(self, pid: int, reason: str, healthy_at: float | None) -> None:
        self._set_state(ProcessState.DOWN)
        now = self._monotonic()
        if healthy_at is None:
            self._failed_starts += 1
        else:
            self._failed_starts = 0
            if now - healthy_at >= self._policy.stable_after_s:
                self._failures = 0
        self._failures += 1
        limit = self._policy.max_failed_starts
        if limit and self._failed_starts >= limit:
            raise EngineGaveUpError(
                f"the engine did not become healthy {self._failed_starts} launches in a row "
                f"(last: {reason}); giving up on `{self._command}`"
            )
        delay_s = self._policy.backoff_s(self._failures)
        log.warning("engine (pid %d) %s%s; restarting in %.1f s (restart %d)", pid, reason,
                    "" if healthy_at is None else f" after {now - healthy_at:.1f} s healthy",
                    delay_s, self.launches)
        waiting = asyncio.ensure_future(self._sleep(delay_s))
        stopping = asyncio.ensure_future(self._stop_requested.wait())
        try:
            await asyncio.wait((waiting, stopping), return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiting.cancel()
            stopping.cancel()
            await asyncio.gather(waiting, stopping, return_exceptions=True)

    async def _terminate(self, process: asyncio.subprocess.Process, *, grace_s: float) -> int:
        """SIGTERM the group, wait `grace_s`, SIGKILL the group; returns the exit code."""
        if process.returncode is None:
            log.info("stopping engine (pid %d): SIGTERM to its process group", process.pid)
            _kill_group(process.pid, signal.SIGTERM)
            try:
                async with asyncio.timeout(grace_s):
                    await asyncio.shield(process.wait())
            except TimeoutError:
                log.warning("engine (pid %d) still running %g s after SIGTERM; SIGKILL",
                            process.pid, grace_s)
        _kill_group(process.pid, signal.SIGKILL)
        code = await asyncio.shield(process.wait())
        await _end_group(process.pid)
        log.info("engine (pid %d) stopped: %s", process.pid, _describe_exit(code))
        return code

    def _set_state(self, state: ProcessState) -> None:
        if state is not self._state:
            self._state = state
            self._on_change(state)


def _kill_group(pgid: int, signum: signal.Signals) -> None:
    """Signal every process in the group (the engine was started as its leader)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


async def _end_group(pgid: int, timeout_s: float = 2.0) -> None:
    """SIGKILL what is left of the group and wait (at most `timeout_s`) until none of it
    runs, so that "stopped" means no process of the engine is running any more."""
    _kill_group(pgid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while _group_running(pgid):
        if time.monotonic() >= deadline:
            log.warning("processes of the engine's group %d outlived SIGKILL by %g s",
                        pgid, timeout_s)
            return
        await asyncio.sleep(0.02)


def _group_running(pgid: int) -> bool:
    """Whether a process of the group still runs. Zombies do not count: orphans are reaped
    by init, which may take seconds. Without /proc: whether the group exists at all."""
    proc = Path("/proc")
    if not (proc / "self" / "stat").exists():
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        # after the command: state, ppid, pgrp, ...
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
