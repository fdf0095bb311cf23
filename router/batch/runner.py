"""What runs batches: every replica runs one `BatchRunner`, and they share the work.

A runner scans the batches that are not finished (router.batch.state) every SCAN_S:
- `validating`: one replica (a lock) reads the input file, checks it
  (router.batch.lines) and queues its chunks, or fails the batch;
- `in_progress`: it claims chunks of lines (leases) while it has room for more (the
  spare slots, and those its lines will free before its next scan: router.batch.room), and
  starts their lines **only into spare capacity**: the slots that the fleet's heartbeats
  show free on the workers serving the batch's model, less what each worker keeps for
  interactive traffic (the peak of its interactive load lately: router.policy.
  batch_room), less what is open there now, this replica's lines included, and never more
  than `batch.max_in_flight` lines of this replica at once (the heartbeats'
  `max_num_seqs` is the worker's word, which a forged heartbeat can inflate). When
  interactive load rises the spare slots shrink and no new line starts; the router queue
  also serves interactive requests first. Each line goes through the request path as the
  `batch` class (the cheapest region with spare slots; the tenant's residency and
  limits). The lines of a model that nobody serves and regions.yaml does not list are let
  go anyway, each answered 404 as an interactive request would be (router.batch.room); a
  batch none of whose lines can run (each faulty) is finalized at once;
- past its `expires_at` a batch is finalized with what is done; `cancelling` and
  `finalizing` batches are finalized (one replica, a lock) once no lease is held: the
  output file has one line per request answered 200, the error file one per other answer,
  faulty line, and (cancelled or expired) line not run.

A line answered 408, 429, 5xx or not routed (no worker with room) is tried again later,
up to MAX_TRIES; a replica that dies has its chunks taken over when their leases end.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import random
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from router.admission.gate import Admission
from router.auth.keys import Principal
from router.batch.blobs import BlobNotFound
from router.batch.entries import error_line, output_line
from router.batch.exchange import LineExchange, retry_after, sender_of
from router.batch.files import FileStore
from router.batch.jobs import UNAVAILABLE, BatchJobs, BatchStats, Warnings
from router.batch.lines import Line
from router.batch.record import Batch
from router.batch.room import LineRoom, StartPace
from router.batch.state import CHUNK_LINES, BatchesUnavailable, BatchStore
from router.config_reload import ConfigHolder
from router.proxy.handlers import Proxy
from router.proxy.replies import REGION_HEADER, WORKER_HEADER

log = logging.getLogger("globalpool.batch")

SCAN_S = 0.5  # how often a runner looks at the batches
DISPATCH_S = 0.05  # how often it starts lines into the spare slots it sees
MAX_TRIES = 6  # a line answered 408/429/5xx or not routed: tries before its error is final
RETRY_AFTER_S = (0.5, 1.0, 2.0, 4.0, 8.0)
RETRYABLE = frozenset({408, 409, 429, 500, 502, 503, 504})
MAX_CHUNKS_PER_SCAN = 8
RECORD_PATIENCE_S = 120.0  # an answer Redis cannot take is kept and written again so long
RECORD_BACKOFF_MAX_S = 1.0


@dataclass(eq=False)
class _Held:
    """A chunk this replica holds a lease on."""

    batch: Batch
    chunk: int
    principal: Principal | None
    pending: collections.deque[tuple[Line, int, float]]  # line, tries so far, not before
    running: int = 0
    stopped: bool = False  # lease lost, or the batch is ending: start no more lines
    done: asyncio.Event = field(default_factory=asyncio.Event)


class BatchRunner:
    """Runs this replica's share of every batch (see the module doc)."""

    def __init__(self, store: BatchStore, files: FileStore, proxy: Proxy,
                 admission: Admission | None, configs: ConfigHolder) -> None:
        self.store = store
        self.files = files
        self.proxy = proxy
        self.admission = admission
        self.configs = configs
        self.holder_id = f"{os.uname().nodename}:{os.getpid()}:{secrets.token_hex(4)}"
        self.stats = BatchStats()
        self._warn = Warnings()
        self.jobs = BatchJobs(store, files, configs, self.stats, self._warn)
        self.room = LineRoom(proxy, configs)
        self._held: list[_Held] = []
        self._holding = asyncio.Event()  # set when a chunk is claimed: dispatching wakes
        self.seen: dict[str, Batch] = {}  # the unfinished batches, as the last scan saw them
        self._tasks: set[asyncio.Task[None]] = set()
        self._running: set[tuple[str, int]] = set()  # (batch, line) sent or being recorded
        self._rng = random.Random()
        self.capped = False  # the last dispatch left spare slots unused for max_in_flight
        self.pace = StartPace()  # lines started lately: how many to hold ready (`_claim`)

    @property
    def lines_running(self) -> int:
        """This replica's lines running now, of every batch (a chunk stays held while any
        of its lines runs): at most batch.max_in_flight."""
        return sum(held.running for held in self._held)

    # --- loops --------------------------------------------------------------------------
    async def run(self) -> None:
        """Scan, dispatch and renew until cancelled (a supervised background task)."""
        dispatching = asyncio.create_task(self._dispatch_forever(), name="batch-dispatch")
        renewing = asyncio.create_task(self._renew_forever(), name="batch-renew")
        try:
            while True:
                if self.configs.current.batch.enabled:
                    try:
                        await self.scan()
                    except UNAVAILABLE as exc:
                        self._warn(f"batches cannot be run now: {exc}")
                await asyncio.sleep(SCAN_S * (0.8 + 0.4 * self._rng.random()))
                for loop in (dispatching, renewing):
                    if loop.done():
                        loop.result()  # a crash: the supervisor restarts the runner
        finally:
            dispatching.cancel()
            renewing.cancel()
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(dispatching, renewing, *self._tasks, return_exceptions=True)
            await self.jobs.stop()

    async def scan(self) -> None:
        """One look at every unfinished batch."""
        self.pace.measure(time.monotonic())
        seen: dict[str, Batch] = {}
        for batch_id in await self.store.active():
            batch = await self.store.get(batch_id, any_owner=True)
            if batch is None:
                await self.store.drop_active(batch_id)
                continue
            seen[batch_id] = batch
            now = time.time()
            if batch.status != "in_progress":  # cancelled or ending: no more lines start
                for held in [held for held in self._held if held.batch.id == batch.id]:
                    self._stop(held)
            if batch.status in ("validating", "in_progress") and now >= batch.expires_at:
                log.info("batch %s expired with %d of %d lines done", batch.id,
                         batch.count("completed") + batch.count("failed"), batch.total)
                await self.store.begin_finalizing(batch.id, int(now), end="expired")
            elif batch.status == "validating":
                await self.jobs.start(batch, "validate", self.holder_id)
            elif batch.status == "in_progress":
                await self._claim(batch)
            elif (batch.status in ("finalizing", "cancelling")
                  and not any(held.batch.id == batch.id for held in self._held)
                  and await self.store.leases_held(batch.id) == 0):
                await self.jobs.start(batch, "finalize", self.holder_id)
        self.seen = seen
        self.room.keep({batch.model for batch in seen.values() if batch.model is not None})

    async def _dispatch_forever(self) -> None:
        while True:
            self._dispatch()
            self._holding.clear()  # nothing held: no wake-up every DISPATCH_S, but at a claim
            await (asyncio.sleep(DISPATCH_S) if self._held else self._holding.wait())

    async def _renew_forever(self) -> None:
        while True:
            lease_s = self.configs.current.batch.lease_s
            await asyncio.sleep(lease_s / 3)
            for held in list(self._held):
                try:
                    status, still = await self.store.renew(
                        held.batch.id, held.chunk, self.holder_id, round(lease_s * 1000))
                except BatchesUnavailable as exc:
                    self._warn(f"cannot renew batch leases: {exc}")
                    break
                if not still or status != "in_progress":
                    if not still and not held.stopped:  # (once: its answers may be pending)
                        log.warning("batch %s: the lease on chunk %d ended (this replica "
                                    "stalled?); another replica runs its lines",
                                    held.batch.id, held.chunk)
                    self._stop(held)

    # --- claiming and running lines -----------------------------------------------------
    async def _claim(self, batch: Batch) -> None:
        if batch.model is None:  # no line can run (each is faulty, its error written)
            await self.store.begin_finalizing(batch.id, int(time.time()))
            return
        principal, refusal = sender_of(batch, self.admission, self.configs.current.auth)
        of_model = [held for held in self._held if held.batch.model == batch.model]
        pending = sum(len(held.pending) for held in of_model)
        # Lines ready for the spare slots now and for those that free before the next scan.
        ahead = self.pace.ahead(sum(held.running for held in of_model), SCAN_S)
        want = min(max(self.room.slots(batch.model, principal), 1) + ahead,
                   self.configs.current.batch.max_in_flight)
        lease_ms = round(self.configs.current.batch.lease_s * 1000)
        for _ in range(MAX_CHUNKS_PER_SCAN):
            if pending >= want and refusal is None:
                return
            status, chunk, held_now = await self.store.claim(batch.id, self.holder_id, lease_ms)
            if chunk is None:
                if status == "in_progress" and held_now == 0:
                    await self.store.begin_finalizing(batch.id, int(time.time()))
                return
            try:
                checked = await self.jobs.input(batch)
            except BlobNotFound:
                # Its input file was deleted while it ran: what ran is kept, the rest is
                # reported as not run (without custom_ids: they were in that file).
                log.warning("batch %s: its input file %s was deleted; ending it", batch.id,
                            batch.input_file_id)
                await self.store.release(batch.id, chunk, self.holder_id)
                await self.store.begin_finalizing(batch.id, int(time.time()), end="failed")
                return
            indexes = list(range(chunk * CHUNK_LINES,
                                 min(batch.total, (chunk + 1) * CHUNK_LINES)))
            missing = await self.store.missing(batch.id, indexes)
            # (Not those still being recorded here: its lease ended and it was claimed again.)
            lines = [line for index in missing if index < checked.total
                     and isinstance(line := checked.lines[index], Line)
                     and (batch.id, index) not in self._running]
            held = _Held(batch, chunk, principal,
                         collections.deque((line, 0, 0.0) for line in lines))
            self._held.append(held)
            self._holding.set()
            if refusal is not None:  # no key to send them as: each line's error, now
                for line in lines:
                    await self._record_error(held, line, "invalid_api_key", refusal)
                held.pending.clear()
            self._check_done(held)
            pending += len(lines)

    def _dispatch(self) -> None:
        """Start lines into the spare slots seen now, oldest chunk first."""
        room: dict[str, int] = {}
        now = time.monotonic()
        self._say_ready()
        budget = self.configs.current.batch.max_in_flight - self.lines_running
        self.capped = False
        for held in list(self._held):
            if held.stopped or not held.pending:
                continue
            model = held.batch.model or ""
            regions = None if held.principal is None else held.principal.allowed_regions
            key = f"{model}\0{sorted(regions) if regions else ''}"
            if key not in room:
                room[key] = self.room.slots(model, held.principal)
            while room[key] > 0 and held.pending and held.pending[0][2] <= now:
                if budget <= 0:
                    self.capped = True
                    return
                line, tries, _ = held.pending.popleft()
                room[key] -= 1
                budget -= 1
                self.pace.started()
                held.running += 1
                task = asyncio.create_task(self._run_line(held, line, tries))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            if held.pending and held.pending[0][2] > now:
                held.pending.rotate(-1)  # one waiting out a retry delay does not block the rest

    async def _run_line(self, held: _Held, line: Line, tries: int) -> None:
        batch = held.batch
        self._running.add((batch.id, line.index))
        try:
            answer = await self._answer(held, line, tries)
            if answer is not None:
                await self._keep_recording(held, line, *answer)
        except (BatchesUnavailable, ConnectionError) as exc:
            # Not recorded: the line runs again (here, or after the lease, elsewhere).
            self._warn(f"batch {batch.id}: line {line.index} not recorded: {exc}")
            held.pending.append((line, tries, time.monotonic() + 1.0))
        finally:
            self._running.discard((batch.id, line.index))
            held.running -= 1
            self._check_done(held)

    async def _answer(self, held: _Held, line: Line, tries: int
                      ) -> tuple[str, bool, str] | None:
        """Send the line; its result entry, whether it was answered 200, and the region
        that answered. None when it was put back to be tried again later."""
        batch = held.batch
        request_id = f"{batch.id}-{line.index}-{tries}"
        started_s = time.monotonic()
        reply = await self.proxy.inference(
            LineExchange(batch.endpoint, line.body, request_id), caller=held.principal)
        region = reply.headers.get(REGION_HEADER, "")
        if reply.status == 429 and not held.stopped:
            # Over the tenant's rate limit: a pace to keep, not a failure.
            self.stats.lines["retried", region] += 1
            held.pending.append((line, tries, time.monotonic() + retry_after(reply)))
            return None
        if reply.status in RETRYABLE and tries + 1 < MAX_TRIES and not held.stopped:
            self.stats.lines["retried", region] += 1
            delay = RETRY_AFTER_S[min(tries, len(RETRY_AFTER_S) - 1)]
            held.pending.append((line, tries + 1, time.monotonic() + delay))
            return None
        try:
            body = json.loads(reply.body)
        except (ValueError, RecursionError):
            body = {"error": {"message": "the answer was not JSON", "type": "server_error"}}
        if ok := reply.status == 200:
            self._count_cost(reply.headers.get(WORKER_HEADER, ""), region,
                             time.monotonic() - started_s)
        return (output_line(batch.id, line.index, line.custom_id, reply.status,
                            reply.headers.get("x-request-id", request_id), body), ok, region)

    async def _keep_recording(self, held: _Held, line: Line, entry: str, ok: bool,
                              region: str) -> None:
        """Record an answer, again while Redis cannot take it (up to RECORD_PATIENCE_S),
        rather than run the line again (the first result written wins). Then raises
        BatchesUnavailable: the line runs again."""
        gives_up_at = time.monotonic() + RECORD_PATIENCE_S
        delay_s = 0.25
        while True:
            try:
                await self._record(held, line, entry, ok, region)
                return
            except BatchesUnavailable as exc:
                if time.monotonic() + delay_s > gives_up_at:
                    raise
                self._warn(f"batch {held.batch.id}: answers not recorded yet (kept, tried "
                           f"again): {exc}")
            await asyncio.sleep(delay_s)
            delay_s = min(RECORD_BACKOFF_MAX_S, delay_s * 2)

    async def _record_error(self, held: _Held, line: Line, code: str, message: str) -> None:
        await self._record(held, line, error_line(held.batch.id, line.index, line.custom_id,
                                                  code, message), ok=False)

    async def _record(self, held: _Held, line: Line, entry: str, ok: bool,
                      region: str = "") -> None:
        first = await self.store.record(held.batch.id, line.index, entry, ok)
        if first is None:  # the batch is gone (Redis lost it): nothing more to run
            if not held.stopped:
                log.warning("batch %s: gone from Redis while its lines ran", held.batch.id)
                self._stop(held)
            return
        self.stats.lines["ok" if ok else "error", region] += 1
        if not first:
            self.stats.lines["rerun", region] += 1

    def _count_cost(self, worker_id: str, region: str, seconds: float) -> None:
        view = self.proxy.holder.current.workers.get(worker_id)
        self.stats.add_cost(region, seconds, self.configs.current.cost_per_gpu_hour(region),
                            view.heartbeat.capacity.max_num_seqs if view is not None else 1)

    def status(self) -> dict[str, Any]:
        """For /admin/status: the unfinished batches as the last scan saw them, and what
        this replica runs of them now."""
        return {
            "active": [{
                "id": batch.id, "owner": batch.owner, "status": batch.status,
                "model": batch.model, "endpoint": batch.endpoint,
                "total": batch.total, "completed": batch.count("completed"),
                "failed": batch.count("failed"), "reruns": batch.count("reruns"),
                "takeovers": batch.count("takeovers"),
                "created_at": batch.doc.get("created_at"), "expires_at": batch.expires_at,
            } for batch in self.seen.values()],
            "here": {"chunks_held": len(self._held), "lines_running": self.lines_running,
                     "lines_waiting": sum(len(held.pending) for held in self._held),
                     "max_in_flight": self.configs.current.batch.max_in_flight,
                     "held_back_by_max_in_flight": self.capped,
                     "interactive_reserve": self.configs.current.batch.interactive_reserve},
        }

    def _check_done(self, held: _Held) -> None:
        """A chunk with nothing pending or running is given back."""
        if held.running or (held.pending and not held.stopped) or held.done.is_set():
            return
        held.done.set()
        if held in self._held:
            self._held.remove(held)
            self._say_ready()
        task = asyncio.create_task(self._release(held))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _say_ready(self) -> None:
        """The models this replica holds lines for: peers leave it a share (batch_room)."""
        self.proxy.policy.context.batch_room.ready = frozenset(
            held.batch.model for held in self._held if held.batch.model and not held.stopped)

    async def _release(self, held: _Held) -> None:
        try:
            await self.store.release(held.batch.id, held.chunk, self.holder_id)
        except BatchesUnavailable as exc:
            self._warn(f"batch {held.batch.id}: chunk {held.chunk} not released (its lease "
                       f"ends by itself): {exc}")

    def _stop(self, held: _Held) -> None:
        held.stopped = True
        held.pending.clear()
        self._check_done(held)
