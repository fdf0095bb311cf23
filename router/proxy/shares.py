"""How sibling router processes share the connections of one listening socket.

Processes that accept on one shared socket are woken together, and the first to run
takes what waits. A burst of keep-alive connections (a load balancer's pool, wrk's 32)
then stays with one process while another idles: measured here, 307 of 320 requests on
one of two processes. `ConnectionShares` is a small file that every process maps, one
number per process: its open connections, or -1 while it does not accept (starting,
stopping, dead: the supervisor writes -1 when one exits). A process whose open
connections are clearly more than an accepting sibling's (`over_share`: by `SLACK` and
by a quarter) waits `DEFER_S` before it accepts, at most `MAX_DEFERS` times in a row, so
that the sibling takes the connection; a sibling that is busy or stuck costs a new
connection at most 2 ms. The margins keep the ordinary ups and downs of short-lived
connections (one per request) from deferring anything.
"""

from __future__ import annotations

import mmap
from pathlib import Path

NOT_ACCEPTING = -1
SLACK = 2
# ... and over a sibling's x this
RATIO = 1.25
DEFER_S = 0.001
MAX_DEFERS = 2
_SLOT_BYTES = 8


def create_shares(path: Path, count: int) -> None:
    """The supervisor's file for `count` processes, none accepting yet."""
    path.write_bytes(NOT_ACCEPTING.to_bytes(_SLOT_BYTES, "little", signed=True) * count)


class ConnectionShares:
    """One process's view of the shares file (see the module doc)."""

    def __init__(self, path: Path, index: int) -> None:
        with path.open("r+b") as file:
            self._map = mmap.mmap(file.fileno(), 0)
        self._slots = memoryview(self._map).cast("q")
        self._index = index

    def set_open(self, connections: int) -> None:
        self._slots[self._index] = connections

    def stop_accepting(self) -> None:
        self._slots[self._index] = NOT_ACCEPTING

    def over_share(self) -> bool:
        """Whether an accepting sibling holds clearly fewer connections than this process
        (more than SLACK fewer, and fewer than this one's / RATIO): it should take the
        next one."""
        slots = self._slots
        mine = slots[self._index]
        return any(other > NOT_ACCEPTING and other + SLACK < mine and other * RATIO < mine
                   for index, other in enumerate(slots) if index != self._index)

    def close(self) -> None:
        self._slots.release()
        self._map.close()


def mark_not_accepting(path: Path, index: int) -> None:
    """The supervisor, for a process that exited: its connections are gone."""
    with path.open("r+b") as file:
        file.seek(index * _SLOT_BYTES)
        file.write(NOT_ACCEPTING.to_bytes(_SLOT_BYTES, "little", signed=True))


def accepting(path: Path, index: int) -> bool:
    """The supervisor: whether process `index` accepts connections (it is serving)."""
    with path.open("rb") as file:
        file.seek(index * _SLOT_BYTES)
        return int.from_bytes(file.read(_SLOT_BYTES), "little", signed=True) > NOT_ACCEPTING
