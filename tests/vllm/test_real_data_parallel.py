"""A data-parallel vLLM server (`--data-parallel-size 2`: two engine cores behind one API
server) under `globalpool worker --launch`: its heartbeat says the slots of both engines,
and one engine wedged while the other steps is reported stuck.

vLLM's --max-num-seqs is per engine, and its /metrics gives each engine's series with an
`engine` label. Before, the agent said --max-num-seqs alone (half the server's slots) and
judged progress by the sums of both engines' step counts: with one engine core stopped
(SIGSTOP: a wedged accelerator, as its API server shows it) and the other stepping, the
sums still moved, so nothing was said while requests sent to the stopped engine waited.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.vllm.pool import (
    GENERATE_ARGS,
    MAX_NUM_SEQS,
    START_TIMEOUT_S,
    Agent,
    RealPool,
    descendants,
)
from worker.engine_metrics import MetricsSample, parse_metrics
from worker.progress import STEP_COUNT
from worker.schema import LifecycleState

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

DP_ARGS = (*GENERATE_ARGS, "--data-parallel-size", "2")
# Each engine core pinned to a core of its own (vLLM's per-rank list, "|"-separated).
DP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
# Long generations, kept up while the test waits (at most MAX_REQUESTS in all): the engine
# left running must still step when the other is found stuck.
REQUESTS = 16
MAX_REQUESTS = 48
TOKENS = 2000


@pytest.fixture
def data_parallel(pool: RealPool, measurements: dict[str, Any]) -> Iterator[Agent]:
    """The server on 127.0.7.1, in us-east; stopped after the test with nothing left."""
    agent = pool.start_agent("us-east", 6, name="dp", engine_args=DP_ARGS, engine_env=DP_ENV)
    try:
        pool.wait_for_state("dp", LifecycleState.READY, timeout_s=START_TIMEOUT_S)
        measurements["time to ready, data-parallel server (s)"] = round(
            time.monotonic() - agent.started_at, 1)
        yield agent
    finally:
        leftovers = pool.stop_agent("dp")
        assert leftovers == [], f"data-parallel server processes left behind: {leftovers}"


def engine_metrics(agent: Agent) -> MetricsSample:
    with urllib.request.urlopen(f"{agent.engine_url}/metrics", timeout=30) as response:
        return parse_metrics(response.read().decode())


def generate(agent: Agent) -> int:
    body = json.dumps({"model": "tiny-llama", "prompt": "count", "max_tokens": TOKENS,
                       "ignore_eos": True}).encode()
    request = urllib.request.Request(f"{agent.engine_url}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return int(response.status)


def engine_core(agent: Agent, rank: int) -> int:
    """The PID of the engine core of data-parallel rank `rank` (vLLM titles it so)."""
    for pid in descendants(agent.process.pid):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if command.startswith(f"VLLM::EngineCore_DP{rank}".encode()):
            return pid
    raise AssertionError(f"no engine core of rank {rank} below the agent")


def running(sample: MetricsSample) -> dict[str, int]:
    return {engine: int(totals["vllm:num_requests_running"])
            for engine, totals in sorted(sample.engines.items())}


def test_a_data_parallel_server_says_both_engines_slots_and_a_wedged_engine_is_found(
        pool: RealPool, data_parallel: Agent, measurements: dict[str, Any]) -> None:
    agent = data_parallel
    beat = pool.heartbeat("dp")
    assert beat is not None
    assert beat.capacity.max_num_seqs == 2 * MAX_NUM_SEQS, beat.capacity
    assert set(engine_metrics(agent).engines) == {"0", "1"}
    with concurrent.futures.ThreadPoolExecutor(MAX_REQUESTS) as executor:
        sent = [executor.submit(generate, agent) for _ in range(REQUESTS)]
        deadline = time.monotonic() + 120
        while not all(count >= 2 for count in running(engine_metrics(agent)).values()):
            assert time.monotonic() < deadline, running(engine_metrics(agent))
            time.sleep(0.2)
        core = engine_core(agent, 1)
        signal_sent = False
        try:
            os.kill(core, signal.SIGSTOP)
            signal_sent = True
            stopped_at = time.monotonic()
            while (beat := pool.heartbeat("dp")) is None or beat.engine.stuck_for_s is None:
                assert time.monotonic() - stopped_at < 60, "never said stuck"
                # Traffic goes on (engine 0 keeps stepping): as many open as at the start.
                if (sum(not future.done() for future in sent) < REQUESTS
                        and len(sent) < MAX_REQUESTS):
                    sent.append(executor.submit(generate, agent))
                time.sleep(0.1)
            said_after_s = time.monotonic() - stopped_at
            # Said while engine 0 still steps: the sums were moving all along.
            first = engine_metrics(agent)
            time.sleep(1.0)
            then = engine_metrics(agent)
        finally:
            if signal_sent:
                os.kill(core, signal.SIGCONT)
        assert beat is not None and beat.state is LifecycleState.DEGRADED, beat
        assert running(first)["0"] > 0, running(first)
        assert then.engines["0"][STEP_COUNT] > first.engines["0"][STEP_COUNT]
        assert then.engines["1"][STEP_COUNT] == first.engines["1"][STEP_COUNT]
        statuses = [future.result(timeout=300) for future in sent]
    assert statuses == [200] * len(statuses)  # the stopped engine's too, once it went on
    back = pool.wait_for_state("dp", LifecycleState.READY, timeout_s=60)
    assert back.engine.stuck_for_s is None
    measurements["data-parallel server, one engine core stopped: said stuck after (s)"] = (
        round(said_after_s, 1))
