"""A router process's fleet view mirrored from its first sibling's (router.registry.feed),
and `keep_fleet_view`, which decides, by the process's place among its siblings, whether
it reads Redis itself, ships its view, or mirrors one.

A mirroring process takes each frame as the first process sent it: heartbeats parsed again
(they were checked there: signatures, rules, order), load figures made into views with
this process's open requests, workers gone dropped, Redis's state copied; then it builds
its own snapshot. It reads no heartbeat, record or message of Redis. When the feed falls
silent for FEED_SILENT_S, closes, or cannot be reached, it follows Redis itself with its
own collector, from the views it had (fail static meanwhile), trying the feed again every
RETRY_S; once a whole table arrives from it, its own collector stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import marshal
import time
from collections import deque
from pathlib import Path
from typing import Protocol

from router.registry.collector import HeartbeatCollector
from router.registry.feed import FEED_SOCKET, FRAME_ITEMS, FULL, HEADER, ViewFeed
from router.registry.worker_view import LoadItems, WorkerView, take_loads
from router.supervisor import Supervised
from worker.schema import Refused, parse_heartbeat

log = logging.getLogger("globalpool.registry")

# No frame for this long (the feed sends one at least every KEEPALIVE_S): the first
# process is gone or stuck.
FEED_SILENT_S = 3.0
# While following Redis itself, the feed is tried again this often.
RETRY_S = 1.0
# At its start a process waits this long for the first process's feed (which opens once
# that process has read Redis) before it reads Redis itself, every STARTUP_RETRY_S.
STARTUP_WAIT_S = 3.0
STARTUP_RETRY_S = 0.1
# A frame announced larger than this is a broken feed (10,000 workers: ~4 MB whole).
MAX_FRAME_BYTES = 256 * 1024 * 1024
# Heartbeats parsed (~20 us each) between two turns of the event loop (load figures: a
# frame's, at most feed.VIEWS_PER_TURN).
HEARTBEATS_PER_TURN = 100


class Place(Protocol):
    """A process's place among its siblings (router.processes.ProcessSlot)."""

    @property
    def index(self) -> int: ...

    @property
    def count(self) -> int: ...

    @property
    def directory(self) -> Path: ...


class _Frames(asyncio.Protocol):
    """The feed's frames as they arrive, undecoded (`frames`); `arrived` is set when one
    does or the connection ends (`closed`)."""

    def __init__(self) -> None:
        self.frames: deque[bytes] = deque()
        self.arrived = asyncio.Event()
        self.closed = False
        self._buffer = bytearray()
        self._transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        while len(buffer) >= HEADER.size:
            (size,) = HEADER.unpack_from(buffer)
            if size > MAX_FRAME_BYTES:
                log.error("fleet view: the first router process announced a frame of %d "
                          "bytes (at most %d); not read", size, MAX_FRAME_BYTES)
                self.close()
                break
            if len(buffer) < HEADER.size + size:
                break
            self.frames.append(bytes(buffer[HEADER.size:HEADER.size + size]))
            del buffer[:HEADER.size + size]
        self.arrived.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.arrived.set()

    def close(self) -> None:
        self.closed = True
        self.arrived.set()
        if self._transport is not None:
            self._transport.close()


class _BrokenFeed(Exception):
    """A frame that is not one."""


class MirroredCollector:
    """What the app asks of a collector (`run`, `synced`, `counts`, `upkeep`, `recheck`,
    `mark_down`, `inject_fault`), for a process that mirrors the feed at `path` into
    `collector`'s table, and runs `collector` itself only while it cannot (module doc)."""

    def __init__(self, collector: HeartbeatCollector, path: Path) -> None:
        self._collector = collector
        self._path = path
        self.synced = asyncio.Event()
        self.mirroring = False
        self.frames = 0
        self.own_reads = 0  # times it began following Redis itself
        # Since the last snapshot: views replaced (a build is due), or refreshed in place.
        self._changed = self._refreshed = False

    @property
    def rejected_heartbeats(self) -> int:
        return self._collector.rejected_heartbeats

    def counts(self) -> dict[str, int]:
        return {**self._collector.counts(), "fleet_view_frames_mirrored": self.frames,
                "fleet_view_own_reads": self.own_reads}

    def upkeep(self) -> dict[str, float]:
        return self._collector.upkeep()

    def recheck(self) -> None:
        self._collector.recheck()

    def mark_down(self) -> None:
        self.mirroring = False
        self._collector.mark_down()

    def inject_fault(self, exc: Exception, times: int = 1) -> None:
        self._collector.inject_fault(exc, times)

    async def run(self) -> None:
        """Mirror the feed while it can be reached; follow Redis itself while not."""
        own: asyncio.Task[None] | None = None
        try:
            frames = await self._connect(wait_s=STARTUP_WAIT_S)
            while True:
                if frames is not None:
                    own = await self._mirror(frames, own)
                if own is None:
                    log.warning("fleet view: the first router process's feed cannot be "
                                "reached; following Redis in this process until it can")
                    own = asyncio.create_task(self._collector.run())
                    self.own_reads += 1
                await asyncio.sleep(RETRY_S)
                if own.done():
                    own.result()  # a crash (never returns otherwise): Supervised restarts
                if self._collector.synced.is_set():
                    self.synced.set()
                frames = await self._connect()
        finally:
            self.mirroring = False
            if own is not None:
                await _stop(own)

    async def _connect(self, wait_s: float = 0.0) -> _Frames | None:
        """A connection to the feed, trying for up to `wait_s`; None if there is none."""
        loop = asyncio.get_running_loop()
        give_up_at_s = time.monotonic() + wait_s
        while True:
            try:
                _, frames = await loop.create_unix_connection(_Frames, str(self._path))
            except OSError:
                if time.monotonic() >= give_up_at_s:
                    return None
                await asyncio.sleep(STARTUP_RETRY_S)
            else:
                return frames

    async def _mirror(self, frames: _Frames,
                      own: asyncio.Task[None] | None) -> asyncio.Task[None] | None:
        """Mirror the feed until it fails; `own`: the collector's task, stopped once the
        whole table has arrived. Returns it (None once stopped)."""
        why = "fell silent"
        try:
            while True:
                batch = await self._next(frames)
                if batch is None:
                    if frames.closed:
                        why = "closed"
                    break
                if not self.mirroring:
                    if own is not None:
                        await _stop(own)
                        own = None
                    self.mirroring = True
                    log.info("fleet view: mirroring the first router process's")
                    await self._apply(batch, first=True)
                else:
                    await self._apply(batch)
        except _BrokenFeed:
            why = "sent a malformed frame"
        finally:
            frames.close()
        if self.mirroring:
            self.mirroring = False
            log.warning("fleet view: the first router process's feed %s; following Redis "
                        "in this process until it is back", why)
        return own

    async def _next(self, frames: _Frames) -> list[bytes] | None:
        """The frames that arrived (waiting up to FEED_SILENT_S for one); None when none
        came or the feed closed."""
        deadline_s = time.monotonic() + FEED_SILENT_S
        while not frames.frames and not frames.closed:  # (a large frame comes in parts)
            frames.arrived.clear()
            left_s = deadline_s - time.monotonic()
            if left_s <= 0:
                return None
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left_s):
                    await frames.arrived.wait()
        if not frames.frames:
            return None
        batch = list(frames.frames)
        frames.frames.clear()
        return batch

    async def _apply(self, batch: list[bytes], first: bool = False) -> None:
        """Take the frames into the table, one at a time; after the last frame of a
        snapshot's changes (`complete`), build a snapshot if any view was replaced, or
        restamp the current one (`SnapshotPublisher.restamp`) if views were only
        refreshed in place or Redis's state moved on. Raises _BrokenFeed for a frame that
        is not one, or when the `first` frame of a connection is not FULL."""
        collector = self._collector
        table, pace = collector.table, collector.pace
        complete = False
        for raw in batch:
            started = time.thread_time()
            try:
                decoded = marshal.loads(raw)
            except (EOFError, ValueError, TypeError):
                decoded = None
            if not isinstance(decoded, tuple) or len(decoded) != FRAME_ITEMS:
                raise _BrokenFeed
            kind, connected, last_ok_at_s, heartbeats, loads, gone, complete = decoded
            if first and kind != FULL:
                raise _BrokenFeed
            first = False
            self.frames += 1
            if kind == FULL:
                collector.forget()
                self._changed = True
            for done, (text, items) in enumerate(heartbeats, 1):
                self._take_heartbeat(text, items)
                if done % HEARTBEATS_PER_TURN == 0:
                    pace.spent(started)
                    await asyncio.sleep(0)
                    started = time.thread_time()
            # (a worker unknown here was dropped by a reload before process 0 dropped it)
            replaced, refreshed = take_loads(table.views, loads, table.local_inflight)
            self._changed |= replaced
            self._refreshed |= refreshed
            for worker_id in gone:
                table.drop(worker_id, worker_id.encode())
            # (load figures taken in place, `refresh`, change nothing a snapshot holds)
            self._changed |= bool(heartbeats or gone) or connected != table.connected
            table.connected, table.last_ok_at_s = connected, last_ok_at_s
            pace.spent(started)
            await asyncio.sleep(0)
        if complete:
            await self._publish()

    async def _publish(self) -> None:
        collector = self._collector
        table, pace = collector.table, collector.pace
        started = time.thread_time()
        if self._changed:
            await collector.publisher.publish_in_turns()
        elif (self._refreshed
              or table.last_ok_at_s != collector.publisher.current.last_redis_ok_at_s):
            collector.publisher.restamp()  # the same views: fresher, and Redis's state
            pace.spent(started)
        self._changed = self._refreshed = False
        if table.connected:
            self.synced.set()

    def _take_heartbeat(self, text: bytes, items: LoadItems) -> None:
        table = self._collector.table
        try:
            heartbeat = parse_heartbeat(text)
        except Refused as exc:  # the first process took it: another version of the code?
            log.error("fleet view: a heartbeat from the first router process does not "
                      "parse here: %s", exc)
            return
        inflight = table.local_inflight(heartbeat.worker_id)
        view = WorkerView(heartbeat, items[11], inflight).mirrored(items, inflight)
        table.put(view, table.views.get(view.worker_id))


async def _stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def keep_fleet_view(collector: HeartbeatCollector, slot: Place | None,
                    background: dict[str, Supervised]) -> HeartbeatCollector | MirroredCollector:
    """Start keeping the fleet view as this process's place says (the module doc), as
    background tasks: alone (no siblings) it runs `collector`; the first of several also
    ships its view; the others mirror it. What the app asks for the view's state."""
    if slot is None or slot.count < 2:
        source: HeartbeatCollector | MirroredCollector = collector
    elif slot.index == 0:
        feed = ViewFeed(collector.table, slot.directory / FEED_SOCKET, collector.synced,
                        collector.pace)
        collector.publisher.on_published = feed.published
        background["fleet-view-feed"] = Supervised("fleet-view-feed", feed.serve).start()
        source = collector
    else:
        source = MirroredCollector(collector, slot.directory / FEED_SOCKET)
    # A crash marks the view as not kept (readiness fails) until the restart reads Redis.
    background["heartbeat-collector"] = Supervised(
        "heartbeat-collector", source.run, on_down=lambda _exc: source.mark_down()).start()
    return source
