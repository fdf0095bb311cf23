"""One fleet view per machine: the first of a router's processes (`--processes N`) ships
its worker table to its siblings, which mirror it (router.registry.mirror) instead of
each reading every heartbeat from Redis.

Keeping the view is parsing and checking every load record and heartbeat, and making a
view of each (BENCHMARKS.md, "Heartbeat plane": ~5 us a heartbeat, paced to a tenth of a
core at 10,000 workers); every process doing it alone cost N times one process's. A
sibling that mirrors takes what the first process decided: it is sent, after each of that
process's snapshots, the views that changed since the last one (a new heartbeat: its
JSON, parsed again there; new load: the figures of `WorkerView.load_items`), the workers
that left, and whether and when Redis last answered. A sibling that connects is first sent
the whole table. At least every KEEPALIVE_S a frame goes out even when nothing changed,
so that a silent feed means a stopped process (the mirror then follows Redis itself).

Frames go over a Unix socket in the supervisor's private directory (0700, created by the
supervisor: router.processes), as a 4-byte length and `marshal` data: only processes of
the same user and supervisor can connect or listen there, and they already trust each
other with every secret the router holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import marshal
import struct
import time
from pathlib import Path

from router.registry.pace import Pace
from router.registry.worker_table import WorkerTable
from router.registry.worker_view import LoadItems, WorkerView, changes_since

log = logging.getLogger("globalpool.registry")

# The socket's name in the supervisor's directory.
FEED_SOCKET = "view.sock"
# A frame goes out at least this often (see the module doc).
KEEPALIVE_S = 0.5
# Views looked at, and load figures put in one frame, between two turns of the event
# loop (~1 ms; one frame of a 10,000-worker fleet's changes took ~5-10 ms to encode,
# and as long to decode, with every request waiting meanwhile).
VIEWS_PER_TURN = 1_000
# Heartbeats (~650 B of JSON each) in one frame.
HEARTBEATS_PER_FRAME = 200
# A sibling that has not read this much of what was sent to it is cut off: it connects
# again and is sent the whole table (a 10,000-worker table is ~1.5 MB).
MAX_UNREAD_BYTES = 32 * 1024 * 1024
# The frame kinds (the first item of a frame).
FULL, CHANGES = 1, 2
FRAME_ITEMS = 7  # kind, connected, last_ok_at_s, heartbeats, loads, gone, complete
HEADER = struct.Struct(">I")

# A heartbeat as shipped: its JSON and the view's load items.
Shipped = tuple[bytes, LoadItems]


def frame(kind: int, table: WorkerTable, heartbeats: list[Shipped], loads: list[LoadItems],
          gone: list[str], complete: bool = True) -> bytes:
    """A frame as it goes on the socket (see the module doc); `complete`: the last of
    the frames that carry one snapshot's changes (the mirror builds its snapshot then)."""
    body = marshal.dumps((kind, table.connected, table.last_ok_at_s, heartbeats, loads, gone,
                          complete))
    return HEADER.pack(len(body)) + body


class ViewFeed:
    """Serves `table` on `path` to sibling processes (`serve`, a background task); the
    collector's publisher calls `published` after each snapshot."""

    def __init__(self, table: WorkerTable, path: Path, synced: asyncio.Event,
                 pace: Pace) -> None:
        """`synced`: set once the table has been read from Redis (the feed opens then);
        `pace`: the collector's, which counts what shipping costs as upkeep and paces the
        collector's builds by it too (Pace.shipped_s)."""
        self._table = table
        self._pace = pace
        self._path = path
        self._synced = synced
        self._due = asyncio.Event()
        self._followers: list[asyncio.StreamWriter] = []  # sent the whole table already
        self._joining: list[asyncio.StreamWriter] = []  # to be sent it next
        self._shipped: dict[str, WorkerView] = {}  # the views the followers have

    def published(self) -> None:
        """A snapshot was made current: ship what changed (at the feed's next turn)."""
        if self._followers or self._joining:
            self._due.set()
        else:
            self._pace.shipped_s = 0.0  # nobody to ship to: no cost to pace by

    async def serve(self) -> None:
        """Accept siblings and ship to them until cancelled."""
        await self._synced.wait()
        with contextlib.suppress(FileNotFoundError):
            self._path.unlink()  # left by this slot's previous process
        server = await asyncio.start_unix_server(self._join, path=str(self._path))
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(KEEPALIVE_S):
                        await self._due.wait()
                if self._due.is_set() or self._joining:
                    self._due.clear()
                    await self._ship()
                elif self._followers:  # nothing published: say so, and that it lives
                    self._send(self._followers, frame(CHANGES, self._table, [], [], []))
        finally:
            server.close()
            for writer in (*self._followers, *self._joining):
                writer.close()
            with contextlib.suppress(FileNotFoundError):
                self._path.unlink()

    async def _join(self, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._joining.append(writer)
        self._due.set()

    async def _ship(self) -> None:
        """Send the followers what changed since the last frame, and those joining the
        whole table, both as it is now."""
        pace = self._pace
        started = time.thread_time()
        pace.shipped_s = 0.0
        views = list(self._table.views.items())
        new: list[WorkerView] = []
        loads: list[LoadItems] = []
        shipped: dict[str, WorkerView] = self._shipped
        current: dict[str, WorkerView] = {}
        # A thousand views a turn: the views replaced are freed as they are popped from
        # `shipped`, not ten thousand at once when it is replaced (~5-10 ms).
        for start in range(0, len(views), VIEWS_PER_TURN):
            changes_since(views[start:start + VIEWS_PER_TURN], shipped, current, new, loads)
            if start + VIEWS_PER_TURN < len(views):
                pace.shipped_s += pace.spent(started)
                await asyncio.sleep(0)
                started = time.thread_time()
        gone = list(shipped)  # the workers left after the scan are those that left
        self._shipped = current
        pace.shipped_s += pace.spent(started)
        heartbeats = await self._as_shipped(new, counted=True)
        await self._send_in_frames(self._followers, CHANGES, heartbeats, loads, gone)
        joining, self._joining = self._joining, []
        if joining:
            whole = await self._as_shipped([view for _, view in views], counted=False)
            await self._send_in_frames(joining, FULL, whole, [], [])
            log.info("fleet view: %d sibling process(es) joined; %d workers sent",
                     len(joining), len(whole))
        self._followers.extend(writer for writer in joining if not writer.is_closing())

    async def _as_shipped(self, views: list[WorkerView], counted: bool) -> list[Shipped]:
        """Each of `views` as a heartbeat is shipped (its JSON, ~10 us, and its load
        items), VIEWS_PER_TURN of them between two turns of the event loop; `counted`:
        the CPU this takes goes to the pace (Pace.shipped_s), as a snapshot's changes do
        (a joining sibling's whole table does not)."""
        pace = self._pace
        shipped: list[Shipped] = []
        for start in range(0, len(views), VIEWS_PER_TURN):
            started = time.thread_time()
            shipped.extend((_json(view), view.load_items())
                           for view in views[start:start + VIEWS_PER_TURN])
            if counted:
                pace.shipped_s += pace.spent(started)
            await asyncio.sleep(0)
        return shipped

    async def _send_in_frames(self, writers: list[asyncio.StreamWriter], kind: int,
                              heartbeats: list[Shipped], loads: list[LoadItems],
                              gone: list[str]) -> None:
        """Send these changes as frames of at most HEARTBEATS_PER_FRAME heartbeats and
        VIEWS_PER_TURN load figures, the last one `complete` (the first one of `kind`, the
        rest CHANGES), with a turn of the event loop after each."""
        pace = self._pace
        first = True
        while first or heartbeats or loads:
            started = time.thread_time()
            some_heartbeats, heartbeats = (heartbeats[:HEARTBEATS_PER_FRAME],
                                           heartbeats[HEARTBEATS_PER_FRAME:])
            some_loads, loads = loads[:VIEWS_PER_TURN], loads[VIEWS_PER_TURN:]
            last = not heartbeats and not loads
            self._send(writers, frame(kind if first else CHANGES, self._table,
                                      some_heartbeats, some_loads, gone if last else [],
                                      complete=last))
            pace.shipped_s += pace.spent(started)
            first = False
            if not last:
                await asyncio.sleep(0)

    def _send(self, writers: list[asyncio.StreamWriter], data: bytes) -> None:
        """Write `data` to each of `writers`, dropping those closed or too far behind."""
        for writer in list(writers):
            if writer.is_closing():
                writers.remove(writer)
                continue
            if writer.transport.get_write_buffer_size() > MAX_UNREAD_BYTES:
                log.warning("fleet view: a sibling process fell %d MB behind; cut off (it "
                            "connects again for the whole table)", MAX_UNREAD_BYTES >> 20)
                writer.close()
                writers.remove(writer)
                continue
            writer.write(data)


def _json(view: WorkerView) -> bytes:
    return view.heartbeat.model_dump_json().encode()
