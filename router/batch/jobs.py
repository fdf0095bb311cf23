"""A batch's two one-replica jobs, each under a lock: validation (read the input file,
check it, queue its chunks or fail the batch) and finalization (write the output and
error files from the lines' results, then end the batch); and the parsed input files
that the runner also reads its lines from."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field

from router.batch.blobs import BlobNotFound, BlobStoreError
from router.batch.entries import error_line
from router.batch.files import FileStore, FilesUnavailable
from router.batch.lines import CheckedInput, FileFault, check_input
from router.batch.record import Batch
from router.batch.state import BatchesUnavailable, BatchStore
from router.config_reload import ConfigHolder

log = logging.getLogger("globalpool.batch")

INPUTS_KEPT = 4  # input files kept parsed in memory (each up to batch.max_file_bytes)
WARN_EVERY_S = 10.0
# What a job cannot do now (Redis or the storage unreachable): it is tried again later.
UNAVAILABLE = (BatchesUnavailable, FilesUnavailable, BlobStoreError)


@dataclass
class BatchStats:
    """This replica's counters, for /metrics (router.batch.metrics)."""

    # Lines run here by (outcome, region): ok (200), error (any other final answer, or
    # none), retried (408/429/5xx/not routed: tried again), rerun (already had a result).
    lines: Counter[tuple[str, str]] = field(default_factory=Counter)
    batches: Counter[str] = field(default_factory=Counter)  # finished here, by status
    # A rough cost of the lines served, by region: each line's time on its worker times
    # the region's cost_per_gpu_hour, shared by the worker's max_num_seqs slots.
    cost: dict[str, float] = field(default_factory=dict)

    def add_cost(self, region: str, seconds: float, price_per_gpu_hour: float,
                 slots: int) -> None:
        """A line's share of its worker (one of `slots`) for `seconds`, at the price."""
        self.cost[region] = (self.cost.get(region, 0.0)
                             + seconds / 3600.0 * price_per_gpu_hour / max(1, slots))


class Warnings:
    """A warning at most every WARN_EVERY_S: a Redis outage is said, not repeated for
    every batch and line."""

    def __init__(self) -> None:
        self._warned_at = float("-inf")

    def __call__(self, message: str) -> None:
        now = time.monotonic()
        if now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            log.warning("%s", message)


def _missing(input_file_id: str) -> CheckedInput:
    return CheckedInput(None, (), (FileFault(
        "invalid_file", f"the input file {input_file_id} no longer exists"),))


class BatchJobs:
    """Validation and finalization, one replica each (a lock in Redis), and the parsed
    input files (see the module doc)."""

    def __init__(self, store: BatchStore, files: FileStore, configs: ConfigHolder,
                 stats: BatchStats, warn: Callable[[str], None]) -> None:
        self.store = store
        self.files = files
        self.configs = configs
        self.stats = stats
        self.warn = warn
        self._inputs: OrderedDict[str, CheckedInput] = OrderedDict()
        self._tasks: dict[tuple[str, str], asyncio.Task[None]] = {}  # (batch, job) -> task

    async def start(self, batch: Batch, job: str, holder: str) -> None:
        """Run `job` ("validate" or "finalize") on `batch` here, unless it runs already,
        here or (its lock held) on another replica."""
        if (batch.id, job) in self._tasks:
            return
        lease_ms = round(self.configs.current.batch.lease_s * 1000)
        if not await self.store.lock(batch.id, job, holder, lease_ms):
            return
        work: Callable[[Batch], Coroutine[None, None, None]] = (
            self._validate if job == "validate" else self._finalize)
        task = asyncio.create_task(work(batch), name=f"batch-{job}")
        self._tasks[batch.id, job] = task
        task.add_done_callback(lambda _: self._tasks.pop((batch.id, job), None))

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def input(self, batch: Batch) -> CheckedInput:
        """The batch's input file, checked (kept for the newest INPUTS_KEPT batches).
        Raises BlobNotFound when the file was deleted, other BlobStoreErrors and
        FilesUnavailable when it cannot be read now.

        Only validation applies `batch.max_lines`: a batch accepted runs to its end under
        the limit it was validated with, whatever a reload sets since (a lower limit would
        otherwise check the file anew, find fewer lines than the batch has, and lose
        track of the rest)."""
        checked = self._inputs.get(batch.id)
        if checked is None:
            data = await self.files.read(batch.input_file_id)
            max_lines = (self.configs.current.batch.max_lines
                         if batch.status == "validating" else None)
            checked = check_input(data, batch.endpoint, max_lines)
            self._inputs[batch.id] = checked
            while len(self._inputs) > INPUTS_KEPT:
                self._inputs.popitem(last=False)
        self._inputs.move_to_end(batch.id)
        return checked

    async def _validate(self, batch: Batch) -> None:
        try:
            if await self.files.get(batch.input_file_id, batch.owner) is None:
                checked = _missing(batch.input_file_id)
            else:
                try:
                    checked = await self.input(batch)
                except BlobNotFound:
                    checked = _missing(batch.input_file_id)
            if await self.store.validated(batch, checked, int(time.time())):
                log.info("batch %s: %s", batch.id,
                         f"{checked.total} lines, model {checked.model}" if not checked.faults
                         else f"failed validation: {checked.faults[0].message}")
                if checked.faults:
                    self.stats.batches["failed"] += 1
        except UNAVAILABLE as exc:
            self.warn(f"batch {batch.id}: validation put off: {exc}")

    async def _finalize(self, batch: Batch) -> None:
        try:
            await self._write_results(batch)
        except UNAVAILABLE as exc:
            self.warn(f"batch {batch.id}: finalization put off: {exc}")

    async def _write_results(self, batch: Batch) -> None:
        status = "cancelled" if batch.status == "cancelling" else batch.end
        results = await self.store.results(batch.id)
        total = batch.total
        # Cancelled (or expired) before its validation ended: its lines are in its file.
        unvalidated = total == 0 and not batch.fields.get("in_progress_at")
        checked = None
        unanswered = sum(results.get(index) is None for index in range(total))
        if unanswered or unvalidated:
            with contextlib.suppress(BlobNotFound):  # (deleted: the custom_ids are unknown)
                checked = await self.input(batch)
        if unvalidated and checked is not None and not checked.faults:
            total = checked.total
        unfinished = sum(index not in results for index in range(total))
        output: list[str] = []
        errors: list[str] = []
        for index in range(total):
            entry = results.get(index)
            if entry is None:
                custom_id = (checked.lines[index].custom_id
                             if checked is not None and index < checked.total else None)
                errors.append(error_line(batch.id, index, custom_id, f"batch_{status}",
                                         f"the batch was {status} before this request ran")
                              if index not in results else
                              error_line(batch.id, index, custom_id, "result_not_signed",
                                         "this request's result in Redis was not written "
                                         "by a router (not signed by a heartbeat key)"))
            elif '"status_code":200,' in entry:
                output.append(entry)
            else:
                errors.append(entry)
        output_id = await self._file(batch, "output", output)
        error_id = await self._file(batch, "error", errors)
        if await self.store.finished(batch, status, int(time.time()), output_id, error_id):
            self.stats.batches[status] += 1
            self._inputs.pop(batch.id, None)
            log.info("batch %s %s: %d answered, %d errors (%d not run)", batch.id, status,
                     len(output), len(errors), unfinished)
        else:  # another replica finished it meanwhile: its files are the batch's
            for file_id in filter(None, (output_id, error_id)):
                await self.files.delete(file_id, batch.owner)

    async def _file(self, batch: Batch, kind: str, lines: list[str]) -> str | None:
        """The batch's `kind` file ("output", "error") with `lines`; None when empty."""
        if not lines:
            return None
        record = await self.files.create_bytes(batch.owner, f"{batch.id}_{kind}.jsonl",
                                               "batch_output",
                                               ("\n".join(lines) + "\n").encode())
        return record.id
