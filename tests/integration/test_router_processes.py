"""`globalpool router --processes N` as real processes: one port, the whole machine's
metrics, reloads that reach every process, and a process that dies (SIGKILL) or restarts
(SIGTERM) started again while its sibling keeps serving (router.processes)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import yaml

from lab.devstack.valkey import free_port
from router.processes import DIR_ENV, INDEX_ENV
from tests.integration.conftest import StartSim
from tests.procfs import children
from worker.heartbeat_keys import HeartbeatKeys
from worker.publisher import HeartbeatPublisher
from worker.redis_client import connect
from worker.schema import Capacity, Heartbeat, LifecycleState, Load

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "processes-test-token"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


@dataclass
class Machine:
    """A supervisor and its router processes, in front of two simulators."""

    supervisor: subprocess.Popen[bytes]
    url: str
    config: Path
    log: Path

    def children(self) -> dict[int, int]:
        """{process index: pid} of the supervisor's router processes now."""
        found: dict[int, int] = {}
        for pid in children(self.supervisor.pid):
            try:
                environ = _environ(pid)
            except OSError:  # exited, not yet reaped
                continue
            if INDEX_ENV in environ:
                found[int(environ[INDEX_ENV])] = pid
        return found

    def own_metrics(self, index: int) -> str:
        """Process `index`'s own metrics, read from its socket as its siblings read it."""
        pid = self.children()[index]
        path = Path(_environ(pid)[DIR_ENV]) / f"metrics-{index}.sock"
        import socket

        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(5)
            sock.connect(str(path))
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {key.decode(): value.decode() for key, value in pairs}


def sample(text: str, name: str, **labels: str) -> float:
    """The sum of `name`'s series in `text` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{name}(?:{{(.*)}})? (\S+)$", line)
        if match and all(f'{key}="{value}"' in (match.group(1) or "")
                         for key, value in labels.items()):
            total += float(match.group(2))
    return total


async def until(check: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.1)



async def spawn_machine(config: Path, port: int, log: Path, processes: int, *,
                        wait: bool = True) -> Machine:
    """`globalpool router --config CONFIG --processes N` on `port`, logging to `log`;
    returned once every process listens (`wait`)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("GLOBALPOOL_") and k != "REDIS_URL"}  # (the config's)
    env["GLOBALPOOL_ADMIN_TOKEN"] = TOKEN
    supervisor = _spawn(["router", "--config", str(config), "--processes", str(processes)],
                        log, env)
    found = Machine(supervisor, f"http://127.0.0.1:{port}", config, log)
    deadline = time.monotonic() + 60
    while wait and (text := await asyncio.to_thread(log.read_text)).count(
            "router listening on") < processes:
        assert supervisor.poll() is None, text
        assert time.monotonic() < deadline, text
        await asyncio.sleep(0.05)
    return found


async def two_workers(publisher: HeartbeatPublisher, start_sim: StartSim,
                      **sim_changes: object) -> None:
    """Simulators `a` and `b` in us-east, 64 slots each, published ready."""
    for index, worker_id in enumerate(("a", "b")):
        sim = await start_sim(served_model_names=("m",), seed=index, **sim_changes)
        await publisher.publish(Heartbeat(
            worker_id=worker_id, region="us-east", endpoint=sim.url, models=("m",),
            state=LifecycleState.READY, capacity=Capacity(max_num_seqs=64),
            load=Load(running=0, waiting=0, kv_cache_usage=0.0), seq=1,
            sent_at_s=time.time(), ttl_s=600.0))

def machine_config(path: Path, redis_url: str, prefix: str, port: int) -> Path:
    """A regions.yaml for one region, us-east, serving model `m`, at `path`."""
    path.write_text(yaml.safe_dump({
        "apiVersion": "globalpool/v1",
        "redis": {"url": redis_url, "key_prefix": prefix},
        "router": {"region": "us-east", "port": port, "host": "127.0.0.1"},
        "admin": {"config_check_s": 0},  # reloads only when asked: they are the test
        "heartbeat": {"insecure": True},  # the test publishes unsigned heartbeats
        "regions": {"us-east": {"models": ["m"]}},
    }))
    return path


@pytest.fixture
async def machine(redis_url: str, tmp_path: Path, start_sim: StartSim
                  ) -> AsyncIterator[Callable[..., Awaitable[Machine]]]:
    started: list[Machine] = []
    publisher = HeartbeatPublisher(connect(redis_url), HeartbeatKeys(
        prefix := f"gptest-{uuid.uuid4().hex[:10]}"))

    async def start(processes: int = 2, **sim_changes: object) -> Machine:
        await two_workers(publisher, start_sim, **sim_changes)
        port = free_port()
        config = machine_config(tmp_path / "regions.yaml", redis_url, prefix, port)
        found = await spawn_machine(config, port, tmp_path / "router.log", processes)
        started.append(found)
        return found

    yield start
    for each in started:
        if each.supervisor.poll() is None:
            each.supervisor.terminate()
            await asyncio.to_thread(each.supervisor.wait, 90)
    await publisher.aclose()


def _spawn(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, "-m", "router.cli", *args], cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)  # its own group, as in a terminal


async def chat(http: aiohttp.ClientSession, url: str, *, stream: bool = False) -> int:
    """One request on a new connection (so that the processes take turns accepting):
    its status, or 0 when the connection broke."""
    try:
        async with http.post(f"{url}/v1/chat/completions", json={**CHAT, "stream": stream},
                             headers={"Connection": "close"}) as response:
            await response.read()
            return response.status
    except aiohttp.ClientError:
        return 0


async def test_two_processes_share_the_port_and_metrics_count_both(
        machine: Callable[..., Awaitable[Machine]], http: aiohttp.ClientSession) -> None:
    m = await machine(processes=2)
    assert set(m.children()) == {0, 1}
    statuses = await asyncio.gather(*(chat(http, m.url) for _ in range(60)))
    assert statuses == [200] * 60
    own = [sample(m.own_metrics(index), "globalpool_requests_total") for index in (0, 1)]
    assert sum(own) == 60 and min(own) > 0, own  # both served
    async with http.get(f"{m.url}/metrics") as response:
        merged = await response.text()
    assert sample(merged, "globalpool_requests_total") == 60
    assert sample(merged, "globalpool_router_processes", state="configured") == 2
    assert sample(merged, "globalpool_router_processes", state="answered") == 2
    # The fleet's gauges are the view's, not summed over the processes: 2 workers.
    assert sample(merged, "globalpool_workers") == 2
    assert "2 processes on" in m.log.read_text()


async def test_a_burst_of_keep_alive_connections_is_shared_by_the_processes(
        machine: Callable[..., Awaitable[Machine]]) -> None:
    # 32 clients connect at once and keep their connection for 10 requests each (as wrk
    # does): a process that took the whole burst would serve every request alone.
    m = await machine(processes=2)
    connector = aiohttp.TCPConnector(limit=32, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as http:

        async def client() -> list[int]:
            statuses = []
            for _ in range(10):
                async with http.post(f"{m.url}/v1/chat/completions", json=CHAT) as response:
                    await response.read()
                    statuses.append(response.status)
            return statuses

        results = await asyncio.gather(*(client() for _ in range(32)))
    assert [status for each in results for status in each] == [200] * 320
    own = [sample(m.own_metrics(index), "globalpool_requests_total") for index in (0, 1)]
    assert sum(own) == 320
    assert min(own) >= 0.25 * 320, own


async def test_a_reload_reaches_every_process(
        machine: Callable[..., Awaitable[Machine]], http: aiohttp.ClientSession) -> None:
    m = await machine(processes=2)
    before = {index: _config_version(m.own_metrics(index)) for index in (0, 1)}
    assert len(set(before.values())) == 1
    raw = yaml.safe_load(m.config.read_text())
    raw["router"]["near_equal_ms"] = 7.0
    m.config.write_text(yaml.safe_dump(raw))
    async with http.post(f"{m.url}/admin/reload",
                         headers={"Authorization": f"Bearer {TOKEN}"}) as response:
        assert response.status == 200, await response.text()
        assert (await response.json())["result"] == "reloaded"

    async def everywhere() -> bool:
        versions = {_config_version(m.own_metrics(index)) for index in (0, 1)}
        return versions != set(before.values()) and len(versions) == 1

    await until(everywhere, 10, "the other process never reloaded")
    # SIGHUP to the supervisor does the same for an operator on the machine.
    raw["router"]["near_equal_ms"] = 9.0
    m.config.write_text(yaml.safe_dump(raw))
    seen = {_config_version(m.own_metrics(0))}
    m.supervisor.send_signal(signal.SIGHUP)

    async def both_again() -> bool:
        versions = {_config_version(m.own_metrics(index)) for index in (0, 1)}
        return not versions & seen and len(versions) == 1

    await until(both_again, 10, "SIGHUP did not reload every process")


async def test_a_drain_reaches_every_process(
        machine: Callable[..., Awaitable[Machine]], http: aiohttp.ClientSession) -> None:
    m = await machine(processes=2)
    async with http.post(f"{m.url}/admin/drain", json={"worker": "a", "reason": "test"},
                         headers={"Authorization": f"Bearer {TOKEN}"}) as response:
        assert response.status == 200, await response.text()

    async def everywhere() -> bool:
        return all(sample(m.own_metrics(index), "globalpool_drained", kind="worker") == 1
                   for index in (0, 1))

    await until(everywhere, 10, "the other process never saw the drain")

    async def served_by() -> str:
        async with http.post(f"{m.url}/v1/chat/completions", json=CHAT,
                             headers={"Connection": "close"}) as response:
            assert response.status == 200
            return response.headers["x-globalpool-worker"]

    assert set(await asyncio.gather(*(served_by() for _ in range(20)))) == {"b"}
    own = [sample(m.own_metrics(index), "globalpool_requests_total") for index in (0, 1)]
    assert sum(own) == 20 and min(own) > 0, own  # both processes served, neither on a


def _config_version(metrics: str) -> str:
    match = re.search(r'^globalpool_config_info\{[^}]*version="([^"]+)"', metrics, re.M)
    assert match, metrics[:2000]
    return match.group(1)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["crash", "restart"])
async def test_a_process_that_goes_is_started_again_and_its_sibling_loses_nothing(
        how: signal.Signals, machine: Callable[..., Awaitable[Machine]],
        http: aiohttp.ClientSession) -> None:
    # Streams of ~0.5 s each (50 tokens at 10 ms) from 6 clients, one new connection each.
    m = await machine(processes=2, decode_step_ms=10.0)
    victim = m.children()[0]
    results: list[tuple[float, float, int]] = []  # (sent, done, status)
    stop = asyncio.Event()

    async def client() -> None:
        while not stop.is_set():
            sent = time.monotonic()
            status = await chat(http, m.url, stream=True)
            results.append((sent, time.monotonic(), status))

    clients = [asyncio.create_task(client()) for _ in range(6)]
    try:
        await asyncio.sleep(1.5)
        killed_at = time.monotonic()
        os.kill(victim, how)

        async def replaced() -> bool:
            return m.children().get(0, victim) != victim

        await until(replaced, 30, "the supervisor did not start the process again")
        await asyncio.sleep(1.5)
    finally:
        stop.set()
        await asyncio.gather(*clients)
    failed = [(sent, done) for sent, done, status in results if status != 200]
    after = [status for sent, _, status in results if sent > killed_at + 0.05]
    assert after and set(after) == {200}, "a request sent after the kill failed"
    if how == signal.SIGTERM:  # a graceful restart finishes what it has
        assert failed == [], failed
    else:  # only what the killed process held can fail: at most one per client
        assert len(failed) <= 6 and all(sent < killed_at < done for sent, done in failed)
    assert m.supervisor.poll() is None
    assert "exited with" in m.log.read_text()
    assert set(m.children()) == {0, 1}


@pytest.mark.parametrize("ctrl_c", [False, True], ids=["sigterm", "ctrl-c"])
async def test_stopping_the_supervisor_stops_every_process(
        ctrl_c: bool, machine: Callable[..., Awaitable[Machine]]) -> None:
    m = await machine(processes=2)
    pids = list(m.children().values())
    if ctrl_c:  # a terminal signals the whole group: the processes leave it to the supervisor
        os.killpg(m.supervisor.pid, signal.SIGINT)
    else:
        m.supervisor.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(m.supervisor.wait, 90) == 0
    assert [pid for pid in pids if not _gone(pid)] == []
    assert "starting it again" not in m.log.read_text()


async def test_a_killed_supervisor_takes_its_processes_with_it(
        machine: Callable[..., Awaitable[Machine]]) -> None:
    m = await machine(processes=2)
    pids = list(m.children().values())
    m.supervisor.kill()
    await asyncio.to_thread(m.supervisor.wait, 10)
    deadline = time.monotonic() + 30
    while [pid for pid in pids if not _gone(pid)]:  # reaped by init once they exit
        assert time.monotonic() < deadline, "router processes outlived their supervisor"
        await asyncio.sleep(0.1)


def _gone(pid: int) -> bool:
    """Exited (a zombie not yet reaped by its parent counts: it runs no more)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


async def kill_at_start(m: Machine, slots: set[int], until: Callable[[], bool],
                        timeout_s: float = 60) -> set[int]:
    """SIGKILL every process of `slots` as soon as it appears, until `until()`; the pids
    killed."""
    killed: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while not until():
        assert time.monotonic() < deadline, m.log.read_text()
        for slot, pid in m.children().items():
            if slot in slots and pid not in killed:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
        await asyncio.sleep(0.05)
    return killed


@pytest.mark.slow(why="a process kept dying at start for ~20 s")
async def test_a_process_that_keeps_dying_at_start_while_another_serves_is_retried(
        machine: Callable[..., Awaitable[Machine]]) -> None:
    # Process 0 killed each time within 10 s of its start, process 1 serving: after 5 such
    # exits the replica stays up on process 1, says so, and tries process 0 every 10 s.
    m = await machine(processes=2)
    message = "router process 0 cannot start (exited 5 times in a row); the other"
    killed = await kill_at_start(m, {0}, lambda: message in m.log.read_text())
    assert len(killed) == 5 and m.supervisor.poll() is None
    async with aiohttp.ClientSession() as http:
        assert [await chat(http, m.url) for _ in range(5)] == [200] * 5
    deadline = time.monotonic() + 15  # started again within 10 s
    while m.children().get(0) in (None, *killed):
        assert time.monotonic() < deadline, m.log.read_text()
        await asyncio.sleep(0.1)


@pytest.mark.slow(why="every process dying at start until the supervisor stops (~11 s)")
async def test_processes_that_all_keep_dying_at_start_stop_the_supervisor(
        machine: Callable[..., Awaitable[Machine]]) -> None:
    # Every process killed each time within 10 s of its start: none serves, so after 5
    # such exits of one the supervisor gives up, stops the other, and says why (a
    # broken deployment is not left holding the port with nothing behind it).
    m = await machine(processes=2)
    await kill_at_start(m, {0, 1}, lambda: m.supervisor.poll() is not None)
    assert m.supervisor.returncode == 1
    assert "exited 5 times within 10 s of its start" in m.log.read_text()
    assert "and no other serves" in m.log.read_text()
