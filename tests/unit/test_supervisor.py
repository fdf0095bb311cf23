"""EngineSupervisor against a real child process: a tiny HTTP server standing in for vLLM.

The stand-in (`ENGINE`, stdlib only, starts in ~50 ms) answers /health with 503 or 200,
can exit after a while, ignore SIGTERM, and start a grandchild in its process group, so
that launch, health deadline, crash, restart with backoff, give-up and stop (SIGTERM,
then SIGKILL, to the whole group) are tested without vLLM.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest

from tests.conftest import within
from worker.agent import WorkerAgent
from worker.engine_metrics import MetricsSample, parse_metrics
from worker.heartbeat import EngineView, HeartbeatLoop, HeartbeatTiming, WorkerIdentity, next_state
from worker.heartbeat_keys import HeartbeatKeys
from worker.probe import ProbeResult, ServedModels
from worker.publisher import HeartbeatPublisher
from worker.redis_client import connect
from worker.schema import Heartbeat, LifecycleState
from worker.supervisor import (
    EngineCommand,
    EngineGaveUpError,
    EngineSupervisor,
    ProcessState,
    RestartPolicy,
    http_health_check,
)

ROOT = Path(__file__).resolve().parents[2]

ENGINE = r"""
import argparse, http.server, os, signal, subprocess, sys, time
parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int, required=True)
parser.add_argument("--record", required=True)
parser.add_argument("--healthy-after-s", type=float, default=0.0)
parser.add_argument("--never-healthy", action="store_true")
parser.add_argument("--exit-after-s", type=float)
parser.add_argument("--exit-code", type=int, default=3)
parser.add_argument("--ignore-sigterm", action="store_true")
parser.add_argument("--grandchild", action="store_true")
a = parser.parse_args()
start = time.monotonic()
if a.ignore_sigterm:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
pids = [os.getpid()]
if a.grandchild:
    pids.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]).pid)
with open(a.record, "a") as record:
    record.write(" ".join(map(str, pids)) + "\n")

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        up = not a.never_healthy and time.monotonic() - start >= a.healthy_after_s
        self.send_response(200 if up else 503)
        self.end_headers()
    def log_message(self, *args):
        pass

server = http.server.HTTPServer(("127.0.0.1", a.port), Handler)
server.timeout = 0.05
while a.exit_after_s is None or time.monotonic() - start < a.exit_after_s:
    server.handle_request()
sys.exit(a.exit_code)
"""

FAST = RestartPolicy(start_timeout_s=10.0, initial_backoff_s=0.1, max_backoff_s=0.4,
                     stable_after_s=60.0, max_failed_starts=3, stop_timeout_s=5.0,
                     health_poll_s=0.05)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def alive(pid: int) -> bool:
    """Running (a zombie has exited for our purposes)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():  # noqa: ASYNC110 - files and /proc signal no Event
            await asyncio.sleep(0.02)


@dataclass
class Engine:
    """One stand-in engine command line and what its launches recorded."""

    tmp_path: Path
    port: int = field(default_factory=free_port)

    @property
    def record(self) -> Path:
        return self.tmp_path / "launches.txt"

    def command(self, *flags: str) -> EngineCommand:
        return EngineCommand((sys.executable, "-c", ENGINE, "--port", str(self.port),
                              "--record", str(self.record), *flags))

    def launches(self) -> list[list[int]]:
        """The PIDs (engine, then its grandchild if any) of every launch so far."""
        if not self.record.exists():
            return []
        return [[int(p) for p in line.split()] for line in self.record.read_text().splitlines()]


@dataclass
class Run:
    supervisor: EngineSupervisor
    task: asyncio.Task[None]
    states: list[ProcessState]
    delays: list[float]


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5)) as http:
        yield http


@pytest.fixture
def engine(tmp_path: Path) -> Engine:
    return Engine(tmp_path)


@pytest.fixture
async def start(
    engine: Engine, session: aiohttp.ClientSession
) -> AsyncIterator[Callable[..., Run]]:
    """Start supervisors in tasks; each is stopped afterwards and must leave no process."""
    runs: list[Run] = []

    def launch(command: EngineCommand, policy: RestartPolicy = FAST) -> Run:
        states: list[ProcessState] = []
        delays: list[float] = []

        async def recording_sleep(delay_s: float) -> None:
            delays.append(delay_s)
            await asyncio.sleep(delay_s)

        supervisor = EngineSupervisor(
            command, policy, http_health_check(session, f"http://127.0.0.1:{engine.port}/health"),
            on_change=states.append, sleep=recording_sleep,
        )
        run = Run(supervisor, asyncio.create_task(supervisor.run()), states, delays)
        runs.append(run)
        return run

    yield launch
    for run in runs:
        await run.supervisor.stop()
        await asyncio.gather(run.task, return_exceptions=True)
    left = [pid for pids in engine.launches() for pid in pids if alive(pid)]
    assert left == [], f"processes left behind: {left}"


async def test_launch_until_healthy_then_stop_ends_the_whole_group(
    engine: Engine, start: Callable[..., Run], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="worker.supervisor")
    run = start(engine.command("--healthy-after-s", "0.3", "--grandchild"))
    await until(lambda: run.supervisor.state is ProcessState.HEALTHY)
    [[pid, grandchild]] = engine.launches()
    assert run.supervisor.pid == pid
    assert alive(pid) and alive(grandchild)
    assert run.states == [ProcessState.HEALTHY]

    started = time.monotonic()
    assert await run.supervisor.stop() == -signal.SIGTERM
    async with asyncio.timeout(2.0):
        await run.task
    assert time.monotonic() - started < 2.0
    assert not alive(pid) and not alive(grandchild), "SIGTERM goes to the process group"
    assert run.supervisor.state is ProcessState.STOPPED
    assert run.supervisor.pid is None
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"engine started (pid {pid}, launch 1)") for m in messages)
    assert any(m.startswith("engine healthy ") and f"(pid {pid})" in m for m in messages)


async def test_a_crash_is_restarted_with_a_doubling_bounded_backoff(
    engine: Engine, start: Callable[..., Run], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="worker.supervisor")
    run = start(engine.command("--exit-after-s", "0.2", "--exit-code", "3", "--grandchild"))
    await until(lambda: len(engine.launches()) >= 5)
    await until(lambda: len(run.delays) >= 4)

    assert run.delays[:4] == [0.1, 0.2, 0.4, 0.4], "doubles from initial, capped at max"
    assert ProcessState.DOWN in run.states
    # HEALTHY -> DOWN -> LAUNCHING, again and again
    cycle = [ProcessState.HEALTHY, ProcessState.DOWN, ProcessState.LAUNCHING]
    assert run.states[:6] == cycle * 2
    pids = [launch[0] for launch in engine.launches()]
    assert len(set(pids)) == len(pids)
    grandchildren = [launch[1] for launch in engine.launches()[:-1]]
    assert not any(alive(pid) for pid in grandchildren), "a crashed engine's group is killed"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"engine (pid {pids[0]}) exited with code 3 after " in m
               and "healthy; restarting in 0.1 s (restart 1)" in m for m in warnings), warnings


async def test_a_long_healthy_run_resets_the_backoff(
    engine: Engine, start: Callable[..., Run]
) -> None:
    policy = RestartPolicy(initial_backoff_s=0.1, max_backoff_s=5.0, stable_after_s=0.1,
                           stop_timeout_s=5.0, health_poll_s=0.05)
    run = start(engine.command("--exit-after-s", "0.35"), policy)
    await until(lambda: len(run.delays) >= 3)
    assert run.delays[:3] == [0.1, 0.1, 0.1]


async def test_an_engine_past_its_start_deadline_is_killed_and_then_given_up(
    engine: Engine, start: Callable[..., Run], caplog: pytest.LogCaptureFixture
) -> None:
    # A deadline long enough for a child to start and record itself on a loaded machine.
    policy = RestartPolicy(start_timeout_s=1.5, initial_backoff_s=0.05, max_backoff_s=0.1,
                           max_failed_starts=2, stop_timeout_s=5.0, health_poll_s=0.05)
    run = start(engine.command("--never-healthy", "--grandchild"), policy)
    with pytest.raises(EngineGaveUpError, match=r"did not become healthy 2 launches in a row "
                       r"\(last: did not answer /health within 1.5 s\)"):
        async with asyncio.timeout(20.0):
            await run.task
    assert len(engine.launches()) == 2
    assert run.states == [ProcessState.DOWN, ProcessState.LAUNCHING, ProcessState.DOWN,
                          ProcessState.STOPPED]
    assert not any(alive(pid) for pids in engine.launches() for pid in pids)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert sum("did not answer /health within 1.5 s; killing it" in m for m in errors) == 2


async def test_an_engine_that_exits_at_once_is_given_up_after_max_failed_starts(
    start: Callable[..., Run],
) -> None:
    run = start(EngineCommand((sys.executable, "-c", "import sys; sys.exit(2)")))
    with pytest.raises(EngineGaveUpError, match=r"3 launches in a row \(last: exited with code 2"):
        async with asyncio.timeout(10.0):
            await run.task
    assert run.supervisor.launches == 3
    assert run.delays == [0.1, 0.2]


async def test_a_command_that_cannot_start_is_given_up_at_once(
    start: Callable[..., Run], tmp_path: Path
) -> None:
    run = start(EngineCommand((str(tmp_path / "no-such-vllm"), "serve")))
    with pytest.raises(EngineGaveUpError, match="cannot start the engine"):
        async with asyncio.timeout(5.0):
            await run.task


async def test_stop_escalates_to_sigkill_when_sigterm_is_ignored(
    engine: Engine, start: Callable[..., Run], caplog: pytest.LogCaptureFixture
) -> None:
    policy = RestartPolicy(stop_timeout_s=0.5, health_poll_s=0.05)
    run = start(engine.command("--ignore-sigterm", "--grandchild"), policy)
    await until(lambda: run.supervisor.state is ProcessState.HEALTHY)
    started = time.monotonic()
    assert await run.supervisor.stop() == -signal.SIGKILL
    assert 0.5 <= time.monotonic() - started < 2.0
    async with asyncio.timeout(2.0):
        await run.task
    assert any("SIGKILL" in r.getMessage() for r in caplog.records)


async def test_stop_during_the_backoff_ends_at_once_without_a_relaunch(
    engine: Engine, start: Callable[..., Run]
) -> None:
    policy = RestartPolicy(initial_backoff_s=30.0, max_backoff_s=30.0, health_poll_s=0.05)
    run = start(engine.command("--exit-after-s", "0.3"), policy)
    await until(lambda: run.supervisor.state is ProcessState.DOWN)
    assert await run.supervisor.stop() is not None
    async with asyncio.timeout(1.0):
        await run.task
    assert len(engine.launches()) == 1


async def test_cancelling_run_kills_the_engine(
    engine: Engine, start: Callable[..., Run]
) -> None:
    run = start(engine.command("--grandchild"))
    await until(lambda: run.supervisor.state is ProcessState.HEALTHY)
    run.task.cancel()
    await asyncio.gather(run.task, return_exceptions=True)
    assert not any(alive(pid) for pid in engine.launches()[0])


PARENT = r"""
import asyncio, sys
from worker.supervisor import EngineCommand, EngineSupervisor, RestartPolicy

async def healthy() -> bool:
    return True

async def main() -> None:
    supervisor = EngineSupervisor(EngineCommand(tuple(sys.argv[1:])), RestartPolicy(),
                                  healthy)
    task = asyncio.create_task(supervisor.run())
    while supervisor.pid is None:
        await asyncio.sleep(0.01)
    print(supervisor.pid, flush=True)
    await task

asyncio.run(main())
"""


def test_an_engine_dies_with_its_supervisor_even_on_sigkill(engine: Engine) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, *engine.command().argv], cwd=ROOT,
        stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        assert alive(pid)
        parent.kill()
        parent.wait(5)
        deadline = time.monotonic() + 5
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not alive(pid), "PR_SET_PDEATHSIG sends SIGTERM when the supervisor dies"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


# A supervisor in a session (scheduling group) of its own, so that a regression renices
# only that group: it launches an engine at niceness 10 on the event loop named in
# argv[1] and prints what the kernel says of both.
NICED = r"""
import asyncio, json, os, sys
from pathlib import Path
from worker.supervisor import EngineCommand, EngineSupervisor, ProcessState, RestartPolicy
os.setsid()
record = Path(sys.argv[2])
ENGINE = f"import os, time; open({str(record)!r}, 'w').write(str(os.getpid())); time.sleep(60)"

def group(pid):
    try:
        name, _, nice = Path(f"/proc/{pid}/autogroup").read_text().split()
    except OSError:  # a kernel without autogroup scheduling
        return None, None
    return name, int(nice)

async def main():
    async def healthy():
        return record.exists() and record.read_text() != ""
    policy = RestartPolicy(start_timeout_s=20.0, initial_backoff_s=0.1, max_backoff_s=0.4,
                           stable_after_s=60.0, max_failed_starts=1, stop_timeout_s=5.0,
                           health_poll_s=0.02)
    supervisor = EngineSupervisor(EngineCommand((sys.executable, "-c", ENGINE), niceness=10),
                                  policy, healthy)
    task = asyncio.create_task(supervisor.run())
    while supervisor.state is not ProcessState.HEALTHY:
        await asyncio.sleep(0.02)
    pid = int(record.read_text())
    print(json.dumps({"own": group("self"), "engine": group(pid), "engine_sid": os.getsid(pid),
                      "engine_pid": pid, "engine_nice": os.getpriority(os.PRIO_PROCESS, pid),
                      "own_nice": os.getpriority(os.PRIO_PROCESS, 0)}))
    await supervisor.stop()
    await task

if sys.argv[1] == "uvloop":
    import uvloop
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())
else:
    asyncio.run(main())
"""


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_niced_engine_is_niced_in_its_own_group_not_the_agents(
        loop: str, tmp_path: Path) -> None:
    # uvloop (the agent's loop) runs preexec_fn before setsid: with start_new_session,
    # the engine's autogroup nice landed on the agent's own group, and every process
    # started beside the agent starved behind an engine at full weight.
    done = subprocess.run(
        [sys.executable, "-c", NICED, loop, str(tmp_path / "engine.pid")], cwd=ROOT,
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["engine_sid"] == seen["engine_pid"], "the engine leads a session of its own"
    assert (seen["engine_nice"], seen["own_nice"]) == (10, 0)
    own_group, own_group_nice = seen["own"]
    engine_group, engine_group_nice = seen["engine"]
    if own_group is not None:  # the kernel schedules by autogroup
        assert engine_group != own_group
        assert (engine_group_nice, own_group_nice) == (10, 0), seen


def test_backoff_doubles_and_is_bounded() -> None:
    policy = RestartPolicy(initial_backoff_s=1.0, max_backoff_s=30.0)
    assert [policy.backoff_s(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]
    assert policy.backoff_s(10_000) == 30.0


_DOWN = ProbeResult(health_ok=False, metrics=None, models=None, version=None)


@pytest.mark.parametrize("current", list(LifecycleState))
def test_a_down_engine_process_means_degraded_unless_draining(current: LifecycleState) -> None:
    assert next_state(current, _DOWN, EngineView(), draining=False,
                      engine_down=True) is LifecycleState.DEGRADED
    assert next_state(current, _DOWN, EngineView(), draining=True,
                      engine_down=True) is LifecycleState.DRAINING


_CAPTURE = (ROOT / "tests" / "fixtures" / "vllm-0.32-cpu-metrics.txt").read_text()
_UP = ProbeResult(health_ok=True, metrics=parse_metrics(_CAPTURE),
                  models=ServedModels(("tiny-llama",), ()), version=None)
_SLOW = ProbeResult(health_ok=True, metrics=None, models=None, version=None,
                    errors=("/metrics: timed out",))


class ScriptedProber:
    """Answers with the next scripted result (the last one again once all are used); the
    state of a real engine is not needed to test how results become lifecycle states."""

    def __init__(self, results: list[ProbeResult]) -> None:
        self._results = list(results)
        self.calls = 0

    async def probe(self) -> ProbeResult:
        self.calls += 1
        return self._results.pop(0) if len(self._results) > 1 else self._results[0]


class Collected:
    def __init__(self) -> None:
        self.heartbeats: list[Heartbeat] = []

    async def publish(self, heartbeat: Heartbeat) -> None:
        self.heartbeats.append(heartbeat)


@dataclass
class FakeProcess:
    down: bool = False


async def _states(results: list[ProbeResult], process: FakeProcess | None = None,
                  down_from: int | None = None) -> list[LifecycleState]:
    published = Collected()
    loop = HeartbeatLoop(
        WorkerIdentity("w", "us-east", "http://127.0.0.1:1", 4), ScriptedProber(results),
        published, HeartbeatTiming(interval_s=0.1, ttl_s=1.0), engine_process=process,
    )
    for index in range(len(results)):
        if process is not None and down_from is not None:
            process.down = index >= down_from
        await loop.beat()
    return [beat.state for beat in published.heartbeats]


async def test_one_slow_probe_does_not_degrade_a_ready_worker_two_do() -> None:
    """Two of the last four probes failing degrade a ready worker, in a row or not; it is
    ready again after three good probes in a row."""
    S = LifecycleState
    assert await _states([_UP, _SLOW, _UP, _UP, _UP, _UP, _SLOW, _SLOW, _UP, _UP, _UP]) == [
        S.READY, S.READY, S.READY, S.READY, S.READY, S.READY, S.READY, S.DEGRADED,
        S.DEGRADED, S.DEGRADED, S.READY]
    assert await _states([_UP, _SLOW, _UP, _SLOW, _UP, _SLOW, _UP]) == [
        S.READY, S.READY, S.READY, S.DEGRADED, S.DEGRADED, S.DEGRADED, S.DEGRADED]


async def test_a_down_engine_process_degrades_at_once() -> None:
    S = LifecycleState
    states = await _states([_UP, _SLOW, _SLOW, _UP], FakeProcess(), down_from=1)
    assert states == [S.READY, S.DEGRADED, S.DEGRADED, S.DEGRADED]


_IDLE = ProbeResult(
    health_ok=True,
    metrics=MetricsSample(running=0, waiting=0, kv_cache_usage=0.0,
                          kv_usage_metric="vllm:kv_cache_usage_perc", kv_blocks_total=None,
                          block_size_tokens=None),
    models=ServedModels(("tiny-llama",), ()), version=None)
_BUSY = ProbeResult(health_ok=False, metrics=None, models=None, version=None,
                    errors=("/health: timed out", "/metrics: timed out"))


@pytest.mark.parametrize("launched", [True, False])
async def test_a_drain_waits_for_a_busy_launched_engine_but_not_for_a_vanished_one(
    launched: bool, engine: Engine, session: aiohttp.ClientSession, redis_url: str,
    key_prefix: str,
) -> None:
    """Unanswered probes end a drain only when no engine process is known to be running:
    a launched vLLM too busy to answer /health within the probe timeout is still
    streaming the requests the drain waits for."""
    script = [_UP, _BUSY, _BUSY, _BUSY, _BUSY, _BUSY, _IDLE]
    prober = ScriptedProber(script)
    supervisor = EngineSupervisor(
        engine.command(), FAST,
        http_health_check(session, f"http://127.0.0.1:{engine.port}/health"),
    ) if launched else None
    publisher = HeartbeatPublisher(connect(redis_url), HeartbeatKeys(key_prefix))
    beats = HeartbeatLoop(
        WorkerIdentity("w", "us-east", "http://127.0.0.1:1", 4), prober, publisher,
        HeartbeatTiming(interval_s=0.05, ttl_s=1.0), engine_process=supervisor,
    )
    agent = WorkerAgent(beats, publisher, "w", drain_timeout_s=10.0, engine=supervisor)
    try:
        run = asyncio.create_task(agent.run())
        await until(lambda: prober.calls >= 1)
        agent.request_drain("test")
        assert await within(run, 10.0) == 0
    finally:
        await publisher.aclose()
    if launched:
        assert prober.calls >= len(script), "waited through every unanswered probe"
        assert supervisor is not None and supervisor.state is ProcessState.STOPPED
    else:
        assert prober.calls < len(script), "an unreachable attached engine is not waited for"
