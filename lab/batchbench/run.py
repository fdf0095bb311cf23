"""Run the bench end to end: the stack, the three phases, the report.

    calibration (batch alone) | baseline (interactive alone) | with_batch (both)

Between phases the bench waits until every worker's heartbeat shows nothing running.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from openai import AsyncOpenAI

from lab.batchbench.analysis import Fleet
from lab.batchbench.options import BatchBenchOptions, bench_config
from lab.batchbench.phase import PhasePlan, PhaseRecord, run_phase
from lab.batchbench.probe import FleetProbe
from lab.batchbench.report import write_outputs
from lab.batchbench.results import build_results
from lab.batchbench.workload import batch_jsonl, interactive_spec, sized_rate_per_s
from lab.devstack.stack import LocalStack
from lab.devstack.valkey import free_port
from router.config_loader import load_config

Say = Callable[[str], None]


async def run_bench_batch(options: BatchBenchOptions, say: Say) -> dict[str, Any]:
    """One run; returns results.json's document (also written under options.out)."""
    work = options.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    config_path = bench_config(options.config_path, work)
    config = load_config(config_path)
    load_at_start = os.getloadavg()[0]
    stack = LocalStack(config, config_path, host="127.0.0.1", port=free_port(),
                       log_dir=work / "logs", progress=say,
                       admin_token=secrets.token_urlsafe(16))
    started = time.monotonic()
    await stack.start()
    say(f"stack up in {time.monotonic() - started:.1f} s: router {stack.router_url}, "
        f"logs in {stack.log_dir}")
    try:
        fleet = Fleet(config, {c.name.removeprefix("worker-"): c.region or ""
                               for c in stack.by_role("worker")})
        records = await _phases(options, stack, say)
        exited = [child.name for child in stack.exited()]
    finally:
        say("stopping the stack ...")
        await stack.stop(timeout_s=5.0)
    calibration = next((r for r in records if r.name == "calibration"), None)
    baseline, with_batch = records[-2], records[-1]
    results = build_results(options, fleet, calibration, baseline, with_batch,
                            exited=exited, load_average_at_start=load_at_start)
    write_outputs(options.out, results, records)
    return results


async def _phases(options: BatchBenchOptions, stack: LocalStack, say: Say
                  ) -> list[PhaseRecord]:
    config = stack.config
    model = config.models[0]
    rate = options.rate_per_s or sized_rate_per_s(config, options.interactive_share,
                                                  options.interactive_max_tokens)
    plans = []
    if options.calibration_lines:
        plans.append(PhasePlan(
            "calibration", batch_lines=batch_jsonl(options.calibration_lines, model,
                                                   options.batch_max_tokens),
            batch_total=options.calibration_lines, batch_timeout_s=options.batch_timeout_s))

    def load(duration_s: float) -> Any:
        return interactive_spec(stack.router_url, config, rate_per_s=rate,
                                duration_s=duration_s,
                                max_tokens=options.interactive_max_tokens,
                                request_timeout_s=options.request_timeout_s, seed=options.seed)

    plans.append(PhasePlan("baseline", interactive=load(options.warmup_s + options.baseline_s)))
    # The load's own bound: the batch's, and time to cancel it; the batch's end stops it.
    plans.append(PhasePlan(
        "with_batch", interactive=load(options.warmup_s + options.batch_timeout_s + 90.0),
        batch_lines=batch_jsonl(options.lines, model, options.batch_max_tokens),
        batch_total=options.lines, lead_s=options.warmup_s,
        batch_timeout_s=options.batch_timeout_s))
    records = []
    async with aiohttp.ClientSession() as session, AsyncOpenAI(
            base_url=f"{stack.router_url}/v1", api_key="unused", max_retries=3,
            timeout=60.0) as client:
        assert stack.admin_token is not None
        probe = FleetProbe(stack.router_url, stack.admin_token, session, client)
        for plan in plans:
            if not await probe.idle():
                say("note: the workers were still busy 20 s after the last phase")
            say(f"phase {plan.name}: " + _describe(plan, rate))
            records.append(await run_phase(plan, probe, client, say))
            say(f"phase {plan.name} done in {records[-1].duration_s:.1f} s")
    return records


def _describe(plan: PhasePlan, rate: float) -> str:
    parts = []
    if plan.interactive is not None:
        parts.append(f"{rate:.1f} req/s of streaming chat "
                     f"({plan.interactive.max_tokens} tokens)")
    if plan.batch_lines is not None:
        parts.append(f"a batch of {plan.batch_total} lines")
    return " beside ".join(parts)
