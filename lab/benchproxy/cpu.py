"""CPU time of a process and its descendants, read from /proc (Linux).

`tree_cpu_s(pid)` is user + system time of `pid`, of every live descendant, and of the
children it has already reaped (cutime + cstime), in seconds. Take it before and after a
workload: the difference is what the process tree spent on it. Threads are included
(a process's stat line sums its threads), which matters for the Rust routers. So are
child processes: a `globalpool router --processes N` supervisor is charged with its N
router processes (the descendants are found by their parent PID in every /proc/PID/stat).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
PROC = Path("/proc")


@dataclass(frozen=True, slots=True)
class ProcStat:
    """The fields of /proc/PID/stat this module needs (times in clock ticks)."""

    pid: int
    ppid: int
    utime: int
    stime: int
    cutime: int
    cstime: int

    @property
    def own_ticks(self) -> int:
        return self.utime + self.stime

    @property
    def reaped_children_ticks(self) -> int:
        return self.cutime + self.cstime


def parse_stat(line: str) -> ProcStat:
    """Parse one /proc/PID/stat line. The command name (field 2) may hold spaces and
    parentheses, so the fields are counted from the last ')'. Raises ValueError."""
    open_paren = line.index("(")
    close_paren = line.rindex(")")
    pid = int(line[:open_paren])
    rest = line[close_paren + 2 :].split()
    # rest[0] is field 3 (state); field N is rest[N - 3].
    return ProcStat(pid=pid, ppid=int(rest[1]), utime=int(rest[11]), stime=int(rest[12]),
                    cutime=int(rest[13]), cstime=int(rest[14]))


def read_stat(pid: int, proc: Path = PROC) -> ProcStat | None:
    """The stat of `pid`, or None if it is gone."""
    try:
        return parse_stat((proc / str(pid) / "stat").read_text())
    except (OSError, ValueError, IndexError):
        return None


def _all_stats(proc: Path) -> list[ProcStat]:
    stats = []
    for entry in proc.iterdir():
        if entry.name.isdigit():
            stat = read_stat(int(entry.name), proc)
            if stat is not None:
                stats.append(stat)
    return stats


def descendants(pid: int, stats: list[ProcStat]) -> list[ProcStat]:
    """Every process in `stats` below `pid` in the parent tree (not `pid` itself)."""
    children: dict[int, list[ProcStat]] = {}
    for stat in stats:
        children.setdefault(stat.ppid, []).append(stat)
    found: list[ProcStat] = []
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), ()):
            found.append(child)
            stack.append(child.pid)
    return found


def tree_cpu_s(pid: int, proc: Path = PROC) -> float | None:
    """User + system seconds of `pid`, its live descendants and its reaped children;
    None if `pid` is gone."""
    stats = _all_stats(proc)
    root = next((s for s in stats if s.pid == pid), None)
    if root is None:
        return None
    ticks = root.own_ticks + root.reaped_children_ticks
    ticks += sum(s.own_ticks for s in descendants(pid, stats))
    return ticks / CLOCK_TICKS_PER_S


def cpu_by_process(pid: int, proc: Path = PROC) -> dict[int, float]:
    """CPU seconds of `pid` (with its reaped children) and of each live descendant, by
    PID: how a supervisor's tree shares its work; {} if `pid` is gone."""
    stats = _all_stats(proc)
    root = next((s for s in stats if s.pid == pid), None)
    if root is None:
        return {}
    found = {pid: (root.own_ticks + root.reaped_children_ticks) / CLOCK_TICKS_PER_S}
    found.update((s.pid, s.own_ticks / CLOCK_TICKS_PER_S) for s in descendants(pid, stats))
    return found


def start_ticks(pid: int, proc: Path = PROC) -> int | None:
    """When `pid` started (field 22 of its stat, clock ticks after boot): with the PID, it
    names one process (a PID is reused, a (PID, start) pair is not). None if gone."""
    try:
        line = (proc / str(pid) / "stat").read_text()
        return int(line[line.rindex(")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def live_descendants(pid: int, proc: Path = PROC) -> list[tuple[int, int]]:
    """(PID, start ticks) of every live descendant of `pid`."""
    found = []
    for stat in descendants(pid, _all_stats(proc)):
        started = start_ticks(stat.pid, proc)
        if started is not None:
            found.append((stat.pid, started))
    return found


def cpu_of(pids: dict[str, int], proc: Path = PROC) -> dict[str, float | None]:
    """`tree_cpu_s` of several named processes at (nearly) one moment."""
    return {name: tree_cpu_s(pid, proc) for name, pid in pids.items()}
