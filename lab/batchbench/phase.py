"""One phase of the bench: an interactive load, a batch, or both at once, watched at 1 Hz.

With a batch, the input file is uploaded before the phase's clock starts; the interactive
load (if any) runs `lead_s` alone first, then the batch is created and followed until it
ends (completed, failed, expired, cancelled) or `batch_timeout_s` passes (it is then
cancelled); the interactive load stops when the batch ends. Without a batch the
interactive load runs for its duration. Afterwards the batch's output and error files are
read back to check that every line was answered, once.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from openai import AsyncOpenAI

from lab.batchbench.probe import TERMINAL, FleetProbe, Sample
from lab.bench.stats import percentile
from lab.devstack.loadgen import LoadGenerator, LoadSpec, RequestResult

Say = Callable[[str], None]
PROGRESS_EVERY_S = 5.0


@dataclass
class BatchOutcome:
    """A batch as the client saw it end, and what its files hold."""

    id: str
    status: str
    created_s: float  # seconds since the phase started
    ended_s: float  # when the probe first saw it terminal
    request_counts: dict[str, int]
    answered_ok: int = 0  # output lines with status_code 200
    error_lines: int = 0
    distinct_custom_ids: int = 0
    missing_custom_ids: int = 0  # input lines with no entry in either file
    prompt_tokens_mean: float | None = None
    completion_tokens_mean: float | None = None
    timed_out: bool = False

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


@dataclass
class PhaseRecord:
    """Everything one phase saw; times are seconds since `t0_s` (monotonic)."""

    name: str
    t0_s: float
    duration_s: float = 0.0
    interactive: list[RequestResult] = field(default_factory=list)
    skipped: int = 0
    max_start_lag_s: float = 0.0
    rate_per_s: float | None = None
    samples: list[Sample] = field(default_factory=list)
    batch: BatchOutcome | None = None


@dataclass
class PhasePlan:
    """What one phase runs: an interactive load, a batch (its JSONL file), or both."""

    name: str
    interactive: LoadSpec | None = None
    batch_lines: bytes | None = None
    batch_total: int = 0
    lead_s: float = 0.0
    batch_timeout_s: float = 900.0


async def run_phase(plan: PhasePlan, probe: FleetProbe, client: AsyncOpenAI, say: Say
                    ) -> PhaseRecord:
    """Run `plan` (see the module doc) and return what it saw."""
    input_id = None
    if plan.batch_lines is not None:
        uploaded = await client.files.create(
            file=(f"{plan.name}.jsonl", io.BytesIO(plan.batch_lines)), purpose="batch")
        input_id = uploaded.id
    probe.batch_id = None
    probe.samples = []
    generator = LoadGenerator(plan.interactive) if plan.interactive is not None else None
    stop = asyncio.Event()
    t0_s = time.monotonic()
    record = PhaseRecord(plan.name, t0_s)
    load = asyncio.create_task(generator.run(stop)) if generator is not None else None
    following = asyncio.create_task(probe.follow(t0_s))
    progress = asyncio.create_task(_progress(plan, record, probe, generator, say))
    try:
        if input_id is not None:
            await asyncio.sleep(plan.lead_s)
            record.batch = await _run_batch(plan, input_id, probe, client, t0_s, say)
            stop.set()
        if load is not None and generator is not None:
            await load
            record.interactive = [_relative(r, t0_s) for r in generator.results]
            record.skipped, record.max_start_lag_s = generator.skipped, generator.max_start_lag_s
            record.rate_per_s = generator.spec.rate_per_s
    finally:
        for task in (following, progress, load):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
    record.duration_s = round(time.monotonic() - t0_s, 3)
    record.samples = probe.samples
    if record.batch is not None:
        await _read_files(record.batch, client, plan.batch_total)
    return record


async def _run_batch(plan: PhasePlan, input_id: str, probe: FleetProbe, client: AsyncOpenAI,
                     t0_s: float, say: Say) -> BatchOutcome:
    created = await client.batches.create(input_file_id=input_id,
                                          endpoint="/v1/chat/completions",
                                          completion_window="24h",
                                          metadata={"bench": plan.name})
    created_s = round(time.monotonic() - t0_s, 3)
    probe.batch_id = created.id
    say(f"[{plan.name}] batch {created.id} created: {plan.batch_total} lines")
    deadline = time.monotonic() + plan.batch_timeout_s
    timed_out = False
    while True:
        await asyncio.sleep(0.5)
        last = probe.samples[-1] if probe.samples else None
        if last is not None and last.status in TERMINAL:
            break
        if time.monotonic() >= deadline:
            timed_out = True
            say(f"[{plan.name}] batch {created.id} not done after {plan.batch_timeout_s:g} s: "
                "cancelling it")
            await client.batches.cancel(created.id)
            for _ in range(120):  # the lines running finish; then it is finalized
                batch = await client.batches.retrieve(created.id)
                if batch.status in TERMINAL:
                    break
                await asyncio.sleep(0.5)
            break
    batch = await client.batches.retrieve(created.id)
    counts = batch.request_counts
    return BatchOutcome(
        id=created.id, status=batch.status, created_s=created_s,
        ended_s=round(time.monotonic() - t0_s, 3),
        request_counts={"total": counts.total, "completed": counts.completed,
                        "failed": counts.failed} if counts is not None else {},
        timed_out=timed_out)


async def _read_files(outcome: BatchOutcome, client: AsyncOpenAI, total: int) -> None:
    """Count what the output and error files hold: one entry per input line, once."""
    batch = await client.batches.retrieve(outcome.id)
    seen: Counter[str] = Counter()
    prompt: list[int] = []
    completion: list[int] = []
    for file_id, is_output in ((batch.output_file_id, True), (batch.error_file_id, False)):
        if file_id is None:
            continue
        content = await client.files.content(file_id)
        for text in content.text.splitlines():
            if not text:
                continue
            entry = json.loads(text)
            seen[str(entry.get("custom_id"))] += 1
            response = entry.get("response") or {}
            if is_output and response.get("status_code") == 200:
                outcome.answered_ok += 1
                usage = (response.get("body") or {}).get("usage") or {}
                prompt.append(int(usage.get("prompt_tokens", 0)))
                completion.append(int(usage.get("completion_tokens", 0)))
            else:
                outcome.error_lines += 1
    outcome.distinct_custom_ids = len(seen)
    outcome.missing_custom_ids = sum(f"line-{i}" not in seen for i in range(total))
    if prompt:
        outcome.prompt_tokens_mean = round(sum(prompt) / len(prompt), 2)
        outcome.completion_tokens_mean = round(sum(completion) / len(completion), 2)


def _relative(result: RequestResult, t0_s: float) -> RequestResult:
    """`result` with its times in seconds since `t0_s` (rounded to 0.1 ms)."""
    return RequestResult.from_json(result.to_json(t0_s))


async def _progress(plan: PhasePlan, record: PhaseRecord, probe: FleetProbe,
                    generator: LoadGenerator | None, say: Say) -> None:
    """A line every PROGRESS_EVERY_S: the interactive load's last seconds, the batch."""
    previous: Sample | None = None
    while True:
        await asyncio.sleep(PROGRESS_EVERY_S)
        now_s = time.monotonic() - record.t0_s
        parts = [f"[{plan.name}] t={now_s:6.1f}s"]
        if generator is not None:
            recent = [r for r in generator.results
                      if r.end_s - record.t0_s >= now_s - PROGRESS_EVERY_S]
            ttfts = [t for r in recent if r.ok and (t := r.ttft_ms) is not None]
            p99 = percentile(ttfts, 99)
            failed = sum(not r.ok for r in recent)
            parts.append(f"interactive {len(recent) / PROGRESS_EVERY_S:5.1f} req/s done, "
                         f"{generator.in_flight:3d} open, TTFT p99 "
                         f"{'-' if p99 is None else f'{p99:.0f} ms'}, {failed} failed")
        sample = probe.samples[-1] if probe.samples else None
        if plan.batch_lines is not None and sample is not None:
            parts.append(_batch_progress(sample, previous, plan.batch_total))
            previous = sample
        say(" | ".join(parts))


def _batch_progress(sample: Sample, previous: Sample | None, total: int) -> str:
    line = f"batch {sample.status or 'not created'} {sample.done or 0}/{total}"
    if (previous is not None and sample.ok_by_region is not None
            and previous.ok_by_region is not None and sample.t_s > previous.t_s):
        span = sample.t_s - previous.t_s
        rates = {region: (count - previous.ok_by_region.get(region, 0.0)) / span
                 for region, count in sorted(sample.ok_by_region.items())}
        line += (f" ({sum(rates.values()):.1f} lines/s: "
                 + ", ".join(f"{region} {rate:.1f}" for region, rate in rates.items()) + ")")
    return line
