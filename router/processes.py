"""`globalpool router --processes N`: N serving processes of one replica on one port.

A router process is one Python thread of work: on a machine of several cores it would use
one. With `--processes N` (default: the cores this process may run on) the command
becomes a supervisor that opens the listening socket once and starts N router processes
(`python -m router.cli router ...`) that all accept on it (the socket passed down by file
descriptor, not SO_REUSEPORT: the connections queued on a shared socket survive one
process's exit, where a SO_REUSEPORT socket's queue is reset with it).

Each process is a whole replica: its own fleet view, its own requests, and the peer
exchange (router.registry.peers) tells it its siblings' open requests as it does other
replicas'. What must be the machine's, not one process's:

- `/metrics` on any process merges its siblings' (router.telemetry.machine): counters and
  histograms summed, the fleet's gauges as the answering process sees them;
- drains are Redis's (every process follows them); `/admin/reload` or SIGHUP to the
  supervisor reloads regions.yaml in every process;
- a process that exits while the supervisor is not stopping (a crash, a SIGKILL, a
  graceful SIGTERM of that process alone) is started again, after a backoff when it keeps
  failing at start. The others keep serving: the socket stays open in them.

SIGTERM or SIGINT to the supervisor stops them all (each finishes its requests in
progress, up to its shutdown timeout) and then itself. A supervisor that is killed
(SIGKILL) takes them with it: each is sent SIGTERM by the kernel when it goes
(`follow_supervisor`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from router.proxy.shares import accepting, create_shares, mark_not_accepting

log = logging.getLogger("globalpool.processes")

# What the supervisor tells each router process (environment, not arguments: private to
# the user, where arguments are visible to every user in `ps`).
LISTEN_FD_ENV = "GLOBALPOOL_LISTEN_FD"
INDEX_ENV = "GLOBALPOOL_PROCESS_INDEX"
COUNT_ENV = "GLOBALPOOL_PROCESSES"
DIR_ENV = "GLOBALPOOL_PROCESS_DIR"
SUPERVISOR_ENV = "GLOBALPOOL_SUPERVISOR_PID"
STARTS_ENV = "GLOBALPOOL_PROCESS_STARTS"
# In DIR_ENV: each process's open connections (router.proxy.shares).
SHARES_FILE = "connections"

# A process that exits sooner than this after its start failed at start: the next start
# waits (MIN_BACKOFF_S doubling to MAX_BACKOFF_S), and after MAX_QUICK_FAILURES such
# exits in a row the supervisor gives up (a bad environment, not a crash to ride out).
STABLE_AFTER_S = 10.0
MIN_BACKOFF_S = 0.5
MAX_BACKOFF_S = 10.0
MAX_QUICK_FAILURES = 5
# A process that exits is started again after this much, unless a stop came meanwhile.
SETTLE_S = 0.2
# On stop: each process has its own shutdown timeout (requests in progress, 60 s); after
# this much more it is killed.
STOP_GRACE_S = 75.0


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: `taskset` is respected)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class ProcessSlot:
    """Where one router process stands among its supervisor's (from its environment)."""

    index: int
    count: int
    directory: Path  # private to the user (0700): the processes' metrics sockets
    supervisor_pid: int
    listen_fd: int
    starts: int  # 1 for the first start of this slot, 2 after one restart, ...

    @classmethod
    def from_environ(cls, environ: dict[str, str] | os._Environ[str]) -> ProcessSlot | None:
        if LISTEN_FD_ENV not in environ:
            return None
        return cls(index=int(environ[INDEX_ENV]), count=int(environ[COUNT_ENV]),
                   directory=Path(environ[DIR_ENV]),
                   supervisor_pid=int(environ[SUPERVISOR_ENV]),
                   listen_fd=int(environ[LISTEN_FD_ENV]),
                   starts=int(environ.get(STARTS_ENV, "1")))

    @property
    def shares_file(self) -> Path:
        """Each process's open connections (router.proxy.shares)."""
        return self.directory / SHARES_FILE

    def metrics_socket(self, index: int | None = None) -> Path:
        return self.directory / f"metrics-{self.index if index is None else index}.sock"

    def sibling_sockets(self) -> list[Path]:
        return [self.metrics_socket(index) for index in range(self.count)
                if index != self.index]

    def tell_siblings_to_reload(self) -> None:
        """Ask the supervisor to reload regions.yaml in every process (SIGHUP). Only while
        it is still this process's parent: never a signal to a process that took over
        its PID."""
        if os.getppid() == self.supervisor_pid:
            os.kill(self.supervisor_pid, signal.SIGHUP)


_PR_SET_PDEATHSIG = 1


def follow_supervisor(slot: ProcessSlot) -> bool:
    """In a router process: be sent SIGTERM when the supervisor dies (Linux), so that a
    supervisor killed with SIGKILL leaves no processes serving on without it, and leave
    SIGINT to the supervisor. False when it is gone already (this process then must not
    serve)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    # Ctrl-C in a terminal signals the whole process group: the supervisor stops its
    # processes itself (SIGTERM), and one that ended first would be started again.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A reload (SIGHUP) while this process starts would end it (SIGHUP's default action);
    # from when it serves, router.app._serve handles it. One sent before is missed, but
    # the config watcher still sees the file change (unless admin.config_check_s is 0).
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    return os.getppid() == slot.supervisor_pid


def listening_socket(host: str, port: int) -> socket.socket:
    """The socket every router process accepts on, inheritable by them."""
    # Waiting connections: as many as the kernel allows (net.core.somaxconn caps it), as
    # router.proxy.site.LISTEN_BACKLOG asks for one process (not imported: aiohttp would
    # then be in the supervisor's memory, which runs no request).
    sock = socket.create_server((host, port), family=_family(host), backlog=socket.SOMAXCONN)
    sock.set_inheritable(True)
    return sock


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


class _Slot:
    def __init__(self, index: int) -> None:
        self.index = index
        self.process: asyncio.subprocess.Process | None = None
        self.started_s = 0.0
        self.starts = 0
        self.quick_failures = 0


class Supervisor:
    """Runs `count` router processes (`child_args` after `python -m router.cli`) on
    `sock`, starts again any that exits, forwards SIGHUP, stops them on SIGTERM/SIGINT."""

    def __init__(self, child_args: Sequence[str], count: int, sock: socket.socket,
                 environ: dict[str, str]) -> None:
        self._args = list(child_args)
        self._count = count
        self._sock = sock
        self._environ = environ
        self._slots = [_Slot(index) for index in range(count)]
        self._stopping = asyncio.Event()
        self._failed: str | None = None
        self._directory = Path(tempfile.mkdtemp(prefix="globalpool-router-"))  # 0700
        self._shares = self._directory / SHARES_FILE
        create_shares(self._shares, count)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self._stopping.set)
        loop.add_signal_handler(signal.SIGHUP, self._forward, signal.SIGHUP)
        try:
            await asyncio.gather(*(self._keep(slot) for slot in self._slots))
        finally:
            await self._stop_all()
            shutil.rmtree(self._directory, ignore_errors=True)
        if self._failed is not None:
            print(self._failed, file=sys.stderr)
            return 1
        return 0

    async def _keep(self, slot: _Slot) -> None:
        """Start `slot`'s process and start it again whenever it exits, until stopping."""
        backoff_s = MIN_BACKOFF_S
        while not self._stopping.is_set():
            process = await self._start(slot)
            waiting = asyncio.ensure_future(process.wait())
            stopping = asyncio.ensure_future(self._stopping.wait())
            await asyncio.wait((waiting, stopping), return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            if not waiting.done():  # stopping: _stop_all ends it
                waiting.cancel()
                return
            code = waiting.result()
            mark_not_accepting(self._shares, slot.index)  # its connections are gone
            uptime_s = time.monotonic() - slot.started_s
            # A signal sent to every process at once (a service manager's stop) may end
            # this one before the supervisor has read its own: a moment to see it first.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(SETTLE_S):
                    await self._stopping.wait()
            if self._stopping.is_set():
                return
            log.warning("router process %d (pid %d) exited with %s after %.1f s; starting "
                        "it again", slot.index, process.pid, _exit_text(code), uptime_s)
            if uptime_s >= STABLE_AFTER_S:
                slot.quick_failures, backoff_s = 0, MIN_BACKOFF_S
                continue
            slot.quick_failures += 1
            if slot.quick_failures >= MAX_QUICK_FAILURES:
                if not self._serving(slot):
                    self._failed = (f"router process {slot.index} exited "
                                    f"{slot.quick_failures} times within {STABLE_AFTER_S:g} s "
                                    f"of its start (last: {_exit_text(code)}) and no other "
                                    "serves; stopping (see its log above)")
                    self._stopping.set()
                    return
                # The others serve (a regions.yaml broken on disk after they started, and
                # then this one crashed: it cannot start until the file is fixed). Keep
                # them, and try this one again every MAX_BACKOFF_S.
                log.error("router process %d cannot start (exited %d times in a row); the "
                          "other processes serve; trying again every %g s", slot.index,
                          slot.quick_failures, MAX_BACKOFF_S)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(backoff_s):
                    await self._stopping.wait()
            backoff_s = min(MAX_BACKOFF_S, backoff_s * 2)

    async def _start(self, slot: _Slot) -> asyncio.subprocess.Process:
        slot.starts += 1
        fd = self._sock.fileno()
        environ = {**self._environ, LISTEN_FD_ENV: str(fd), INDEX_ENV: str(slot.index),
                   COUNT_ENV: str(self._count), DIR_ENV: str(self._directory),
                   SUPERVISOR_ENV: str(os.getpid()), STARTS_ENV: str(slot.starts)}
        slot.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "router.cli", *self._args, pass_fds=(fd,), env=environ)
        slot.started_s = time.monotonic()
        log.info("router process %d started (pid %d)", slot.index, slot.process.pid)
        return slot.process

    def _serving(self, failing: _Slot) -> bool:
        """Whether a slot other than `failing` has a process that accepts connections."""
        return any(slot is not failing and slot.process is not None
                   and slot.process.returncode is None
                   and accepting(self._shares, slot.index) for slot in self._slots)

    def _running(self) -> list[asyncio.subprocess.Process]:
        return [slot.process for slot in self._slots
                if slot.process is not None and slot.process.returncode is None]

    def _forward(self, signum: int) -> None:
        for process in self._running():
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signum)

    async def _stop_all(self) -> None:
        # No new connection waits in the listening socket's queue while the processes
        # finish what they hold: each closes its own copy as it stops, and this one is
        # the supervisor's (a client is refused at once, and tries another replica).
        self._sock.close()
        running = self._running()
        self._forward(signal.SIGTERM)
        if not running:
            return
        _, late = await asyncio.wait([asyncio.ensure_future(p.wait()) for p in running],
                                     timeout=STOP_GRACE_S)
        if late:
            for process in self._running():
                log.error("router process pid %d did not stop within %g s: killed",
                          process.pid, STOP_GRACE_S)
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
            await asyncio.gather(*(p.wait() for p in running))


def _exit_text(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return signal.Signals(-code).name
    return f"code {code}"


def supervise(child_args: Sequence[str], count: int, host: str, port: int,
              environ: dict[str, str]) -> int:
    """Listen on host:port and run `count` router processes on it until SIGTERM/SIGINT."""
    sock = listening_socket(host, port)
    bound = sock.getsockname()[1]
    print(f"router supervisor (pid {os.getpid()}): {count} processes on "
          f"http://{host}:{bound}", flush=True)
    try:
        return asyncio.run(Supervisor(child_args, count, sock, environ).run())
    finally:
        sock.close()
