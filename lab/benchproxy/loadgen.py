"""The load generator: one process, closed-loop clients over raw keep-alive connections.

    python -m lab.benchproxy.loadgen '{"workload": {...}, "targets": [["127.0.0.1", 8000]],
                                          "path": "/v1/chat/completions", "cpu_pids": {...}}'

Runs the workload's warm-up (bounded by half the time limit), then reads the CPU time
of every process in `cpu_pids` (router, backends, ...; see lab.benchproxy.cpu), runs
the measured phase, waits for
the requests still open, reads the CPU times again, and prints one JSON document. Bounded
by the workload's count and time limit; requests still open `drain_s` after the limit are
abandoned and counted as errors.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from lab.benchproxy.cpu import cpu_of, tree_cpu_s
from lab.benchproxy.httpclient import ConnectionClosed, HttpConnection, connect, encode_post
from lab.benchproxy.stats import summarize
from lab.benchproxy.workloads import Workload
from router.event_loop import new_event_loop

DRAIN_S = 15.0
REQUEST_TIMEOUT_S = 30.0


@dataclass
class Phase:
    """One phase of the run: how many to send, until when, and what came back."""

    budget: int
    deadline_s: float
    issued: int = 0
    ttft_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)

    def take(self) -> bool:
        if self.issued >= self.budget or time.perf_counter() >= self.deadline_s:
            return False
        self.issued += 1
        return True

    def error(self, what: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 5:
            self.error_samples.append(what[:300])


async def _client(target: tuple[str, int], payload: bytes, workload: Workload, phase: Phase,
                  pool: list[HttpConnection | None], slot: int) -> None:
    stream = workload.stream
    # The fake backends send one event per token, a final (usage) event and [DONE].
    events = workload.tokens + 2 if stream else 0
    if workload.stagger_s:
        await asyncio.sleep(slot / workload.concurrency * workload.stagger_s)
    while phase.take():
        connection = pool[slot]
        try:
            if connection is None or connection.closed:
                connection = pool[slot] = await connect(*target)
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                answer = await connection.request(payload)
        except (OSError, ConnectionClosed, TimeoutError) as exc:
            phase.error(f"{type(exc).__name__}: {exc}")
            if connection is not None:
                connection.close()
            pool[slot] = None
            continue
        if answer.status != 200 or answer.body_bytes == 0 or (stream and not answer.saw_done):
            phase.error(f"status {answer.status}, {answer.body_bytes} body bytes, "
                        f"[DONE] {'seen' if answer.saw_done else 'missing'}: "
                        f"{answer.body_head[:200]!r}")
            continue
        if answer.events != events:
            phase.error(f"{answer.events} SSE events, expected {events}")
            continue
        phase.ttft_s.append(answer.first_byte_s - answer.sent_s)
        phase.e2e_s.append(answer.done_s - answer.sent_s)


async def _phase(workload: Workload, targets: list[tuple[str, int]], payloads: list[bytes],
                 budget: int, time_limit_s: float,
                 pool: list[HttpConnection | None]) -> tuple[Phase, float]:
    phase = Phase(budget=budget, deadline_s=time.perf_counter() + time_limit_s)
    started = time.perf_counter()
    tasks = [
        asyncio.create_task(_client(targets[i % len(targets)], payloads[i % len(targets)],
                                    workload, phase, pool, i))
        for i in range(workload.concurrency)
    ]
    done, pending = await asyncio.wait(tasks, timeout=time_limit_s + DRAIN_S)
    for task in pending:
        task.cancel()
        phase.error("abandoned: still open after the time limit")
    for task in done:
        if task.exception() is not None:
            phase.error(repr(task.exception()))
    return phase, time.perf_counter() - started


async def run(spec: dict[str, Any]) -> dict[str, Any]:
    workload = Workload.from_json(spec["workload"])
    targets = [(str(host), int(port)) for host, port in spec["targets"]]
    path = spec.get("path", "/v1/chat/completions")
    body = workload.body()
    payloads = [encode_post(host, port, path, body) for host, port in targets]
    cpu_pids: dict[str, int] = {k: int(v) for k, v in spec.get("cpu_pids", {}).items()}
    pool: list[HttpConnection | None] = [None] * workload.concurrency
    warm, _ = await _phase(workload, targets, payloads, workload.warmup_requests,
                           workload.time_limit_s / 2, pool)
    cpu_before = cpu_of(cpu_pids)
    own_before = tree_cpu_s(os.getpid())
    phase, wall_s = await _phase(workload, targets, payloads, workload.requests,
                                 workload.time_limit_s, pool)
    cpu_after = cpu_of(cpu_pids)
    own_after = tree_cpu_s(os.getpid())
    for connection in pool:
        if connection is not None:
            connection.close()
    completed = len(phase.e2e_s)
    cpu_s = {
        name: (None if cpu_before[name] is None or cpu_after[name] is None
               else cpu_after[name] - cpu_before[name])  # type: ignore[operator]
        for name in cpu_pids
    }
    if own_before is not None and own_after is not None:
        cpu_s["loadgen"] = own_after - own_before
    return {
        "workload": workload.name,
        "completed": completed,
        "errors": phase.errors,
        "error_samples": phase.error_samples,
        "warmup_errors": warm.errors,
        "warmup_error_samples": warm.error_samples,
        "wall_s": wall_s,
        "requests_per_s": completed / wall_s if wall_s > 0 else 0.0,
        "ttft_ms": {k: v * 1000 if k != "count" else v
                    for k, v in summarize(phase.ttft_s).items()},
        "e2e_ms": {k: v * 1000 if k != "count" else v
                   for k, v in summarize(phase.e2e_s).items()},
        "cpu_s": cpu_s,
        "hit_time_limit": phase.issued < workload.requests,
    }


def main() -> None:
    spec = json.loads(sys.argv[1])
    loop = new_event_loop()
    try:
        result = loop.run_until_complete(run(spec))
    finally:
        loop.close()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
