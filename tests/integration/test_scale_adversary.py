"""An adversary's and a fleet's look at issue #25: `globalpool router --processes N`
(router.processes, router.telemetry.machine) and Redis Sentinel URLs, on real processes
(a supervisor and its router processes, simulators, a Valkey of each test's own that the
test may stop, SIGSTOP or restart empty; a real Sentinel group).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from lab.devstack.cluster import ValkeyCluster, key_slot
from lab.devstack.sentinel import SentinelGroup
from lab.devstack.valkey import EmbeddedValkey, free_port
from tests.conftest import skip_unless_slow_tests_are_asked_for
from tests.integration.conftest import StartSim
from tests.integration.test_router_processes import (
    TOKEN,
    Machine,
    sample,
    spawn_machine,
    two_workers,
)
from worker.heartbeat_keys import HeartbeatKeys
from worker.publisher import HeartbeatPublisher
from worker.redis_client import connect

# The slow tier (`pytest -m slow`): ~100 s of supervisors started and stopped, which the
# default run's 15 minutes cannot spare.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(120)]


@pytest.fixture(autouse=True)
def _slow_tier(request: pytest.FixtureRequest) -> None:
    skip_unless_slow_tests_are_asked_for(request.config, "supervisors started and stopped, "
                                                         "~100 s in all")

ROOT = Path(__file__).resolve().parents[2]
ADMIN = {"Authorization": f"Bearer {TOKEN}"}  # (the machines' admin token)


def chat_body(tokens: int = 8, stream: bool = False) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": tokens, "stream": stream,
            "ignore_eos": True, "min_tokens": tokens}


async def post(http: aiohttp.ClientSession, url: str, *, tokens: int = 8,
               stream: bool = False, timeout_s: float = 10.0) -> tuple[int, str]:
    """One request on a new connection: (status, body), or (0, error) when it broke,
    (-1, "") when no answer came within `timeout_s`."""
    try:
        async with asyncio.timeout(timeout_s):
            async with http.post(f"{url}/v1/chat/completions",
                                 json=chat_body(tokens, stream),
                                 headers={"Connection": "close"}) as response:
                return response.status, await response.text()
    except TimeoutError:
        return -1, ""
    except aiohttp.ClientError as exc:
        return 0, type(exc).__name__


async def metrics(http: aiohttp.ClientSession, url: str) -> str:
    async with asyncio.timeout(10):
        async with http.get(f"{url}/metrics", headers={"Connection": "close"}) as response:
            assert response.status == 200
            return await response.text()


@pytest.fixture
def valkey() -> Iterator[EmbeddedValkey]:
    """A Valkey of this test alone (it may be stopped, frozen or restarted empty)."""
    server = EmbeddedValkey.start(die_with_parent=True)
    try:
        yield server
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server.pid, signal.SIGCONT)
        server.stop()


@dataclass
class Started:
    machine: Machine
    prefix: str
    port: int


@pytest.fixture
async def start_machine(tmp_path: Path, start_sim: StartSim
                        ) -> AsyncIterator[Callable[..., Awaitable[Started]]]:
    """A supervisor (`--processes N`) in front of two simulators, as
    test_router_processes' fixture, on the Redis URL each test gives."""
    machines: list[Machine] = []
    publishers: list[HeartbeatPublisher] = []

    async def start(redis_url: str, *, processes: int = 2, port: int | None = None,
                    wait: bool = True, publish_url: str | None = None,
                    **sim_changes: object) -> Started:
        prefix = f"gptest-{uuid.uuid4().hex[:10]}"
        publisher = HeartbeatPublisher(connect(publish_url or redis_url), HeartbeatKeys(
            prefix, sharded="+cluster://" in redis_url))
        publishers.append(publisher)
        await two_workers(publisher, start_sim, **sim_changes)
        port = port or free_port()
        config = tmp_path / f"regions-{port}.yaml"
        config.write_text(yaml.safe_dump({
            "apiVersion": "globalpool/v1",
            "redis": {"url": redis_url, "key_prefix": prefix},
            "router": {"region": "us-east", "port": port, "host": "127.0.0.1"},
            "admin": {"config_check_s": 0},
            "heartbeat": {"insecure": True},
            "regions": {"us-east": {"models": ["m"]}},
        }))
        machine = await spawn_machine(config, port,
                                      tmp_path / f"router-{port}-{len(machines)}.log",
                                      processes, wait=wait)
        machines.append(machine)
        return Started(machine, prefix, port)

    yield start
    for machine in machines:
        for pid in machine.children().values():  # none left frozen
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        if machine.supervisor.poll() is None:
            machine.supervisor.terminate()
            try:
                await asyncio.to_thread(machine.supervisor.wait, 30)
            except subprocess.TimeoutExpired:
                os.killpg(machine.supervisor.pid, signal.SIGKILL)
                machine.supervisor.wait(5)
    for publisher in publishers:
        await publisher.aclose()


def _spawn(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, "-m", "router.cli", *args], cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)


async def until(check: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.1)


def _own_requests(m: Machine) -> dict[int, float]:
    return {index: sample(m.own_metrics(index), "globalpool_requests_total")
            for index in m.children()}


# --- --processes: metrics --------------------------------------------------------------


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["kill", "stop"])
async def test_merged_counters_never_go_backwards_when_a_process_goes(
        how: signal.Signals, valkey: EmbeddedValkey,
        start_machine: Callable[..., Awaitable[Started]],
        http: aiohttp.ClientSession) -> None:
    m = (await start_machine(valkey.url)).machine
    statuses = await asyncio.gather(*(post(http, m.url) for _ in range(40)))
    assert [s for s, _ in statuses] == [200] * 40
    own = _own_requests(m)
    victim_index = max(own, key=lambda index: own[index])
    assert own[victim_index] > 0, own
    before = sample(await metrics(http, m.url), "globalpool_requests_total")
    assert before == 40
    victim = m.children()[victim_index]
    os.kill(victim, how)
    seen: list[float] = []
    try:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and len(seen) < (8 if how == signal.SIGKILL else 3):
            text = await metrics(http, m.url)
            seen.append(sample(text, "globalpool_requests_total"))
            if how == signal.SIGKILL and m.children().get(victim_index, victim) != victim \
                    and sample(text, "globalpool_router_processes", state="answered") == 2:
                break  # the restarted process is in the scrape again
            await asyncio.sleep(0.3)
    finally:
        if how == signal.SIGSTOP:
            os.kill(victim, signal.SIGCONT)
    # A counter of the machine counts every request the machine served; Prometheus reads
    # any decrease as a reset (and rate() then counts the whole total again).
    assert min(seen) >= before, seen


# --- --processes: stopping, crashes, reloads ---------------------------------------------


async def test_sigterm_finishes_what_is_under_way_and_refuses_what_comes_after(
        valkey: EmbeddedValkey, start_machine: Callable[..., Awaitable[Started]],
        http: aiohttp.ClientSession) -> None:
    # Streams and whole answers of ~6 s (300 tokens at 20 ms) hold both processes in
    # their drain when the supervisor gets SIGTERM; a client connects 0.5 s later.
    m = (await start_machine(valkey.url, decode_step_ms=20.0)).machine
    streams = [asyncio.create_task(post(http, m.url, tokens=300, stream=True, timeout_s=30))
               for _ in range(4)]
    singles = [asyncio.create_task(post(http, m.url, tokens=300, timeout_s=30))
               for _ in range(2)]
    await asyncio.sleep(0.8)
    m.supervisor.send_signal(signal.SIGTERM)
    await asyncio.sleep(0.5)
    late_status, _ = await post(http, m.url, timeout_s=2.0)
    results = await asyncio.gather(*streams, *singles)
    # What was under way when the stop came finishes whole.
    assert [status for status, _ in results] == [200] * 6
    assert all("[DONE]" in body for _, body in results[:4]), \
        [body[-200:] for _, body in results[:4]]
    assert await asyncio.to_thread(m.supervisor.wait, 30) == 0
    assert "starting it again" not in m.log.read_text()
    # A client (or a load balancer's probe) that connects during the drain is refused at
    # once (it tries another replica) or served; -1 is a hang in the listen queue.
    assert late_status in (0, 200), late_status


async def test_a_frozen_process_costs_no_new_connection(
        valkey: EmbeddedValkey, start_machine: Callable[..., Awaitable[Started]],
        http: aiohttp.ClientSession) -> None:
    # SIGSTOP (a process stuck, not gone): the supervisor cannot see it, so its sibling
    # must take every new connection.
    m = (await start_machine(valkey.url)).machine
    victim = m.children()[1]
    os.kill(victim, signal.SIGSTOP)
    try:
        results = await asyncio.gather(*(post(http, m.url, timeout_s=5) for _ in range(30)))
        assert [status for status, _ in results] == [200] * 30
    finally:
        os.kill(victim, signal.SIGCONT)
    results = await asyncio.gather(*(post(http, m.url) for _ in range(10)))
    assert [status for status, _ in results] == [200] * 10


async def test_a_bad_file_on_disk_and_one_crash_do_not_take_the_replica_down(
        valkey: EmbeddedValkey, start_machine: Callable[..., Awaitable[Started]],
        http: aiohttp.ClientSession) -> None:
    m = (await start_machine(valkey.url)).machine
    good = m.config.read_text()
    m.config.write_text(good.replace("apiVersion: globalpool/v1",
                                     "apiVersion: globalpool/v1\nrouter_typo: {}"))
    async with http.post(f"{m.url}/admin/reload", headers=ADMIN) as response:
        body = await response.json()
    assert body.get("result") != "reloaded", body  # refused: the running config stands
    results = await asyncio.gather(*(post(http, m.url) for _ in range(10)))
    assert [status for status, _ in results] == [200] * 10
    os.kill(m.children()[0], signal.SIGKILL)  # one crash (an OOM kill, a bug)
    with contextlib.suppress(subprocess.TimeoutExpired):  # exits (the fault) or not in 30 s
        await asyncio.to_thread(m.supervisor.wait, 30)
    # The replica should go on serving on the sibling (and the last good config).
    assert m.supervisor.poll() is None, m.log.read_text()[-1500:]
    results = await asyncio.gather(*(post(http, m.url, timeout_s=5) for _ in range(10)))
    assert [status for status, _ in results] == [200] * 10


async def test_a_refused_reload_then_a_good_one_reach_every_process(
        valkey: EmbeddedValkey, start_machine: Callable[..., Awaitable[Started]],
        http: aiohttp.ClientSession) -> None:
    m = (await start_machine(valkey.url)).machine
    good = yaml.safe_load(m.config.read_text())

    def versions() -> set[str]:
        import re

        found = set()
        for index in (0, 1):
            match = re.search(r'^globalpool_config_info\{[^}]*version="([^"]+)"',
                              m.own_metrics(index), re.M)
            assert match
            found.add(match.group(1))
        return found

    first = versions()
    assert len(first) == 1
    m.config.write_text("regions: [unclosed\n")
    async with http.post(f"{m.url}/admin/reload", headers=ADMIN) as response:
        assert (await response.json()).get("result") != "reloaded"
    await asyncio.sleep(1.0)
    assert versions() == first  # neither process took the broken file
    assert sample(await metrics(http, m.url), "globalpool_config_last_reload_ok") == 0
    good["router"]["near_equal_ms"] = 7.0
    m.config.write_text(yaml.safe_dump(good))
    async with http.post(f"{m.url}/admin/reload", headers=ADMIN) as response:
        assert (await response.json()).get("result") == "reloaded"

    async def everywhere() -> bool:
        now = versions()
        return len(now) == 1 and now != first

    await until(everywhere, 10, "a good reload did not reach every process")
    results = await asyncio.gather(*(post(http, m.url) for _ in range(10)))
    assert [status for status, _ in results] == [200] * 10


async def test_the_port_is_taken_again_at_once_after_a_stop(
        valkey: EmbeddedValkey, start_machine: Callable[..., Awaitable[Started]],
        http: aiohttp.ClientSession) -> None:
    first = await start_machine(valkey.url)
    assert [s for s, _ in await asyncio.gather(*(post(http, first.machine.url)
                                                  for _ in range(6)))] == [200] * 6
    first.machine.supervisor.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(first.machine.supervisor.wait, 30) == 0
    second = await start_machine(valkey.url, port=first.port)
    assert [s for s, _ in await asyncio.gather(*(post(http, second.machine.url)
                                                  for _ in range(6)))] == [200] * 6


# --- Redis under the processes -----------------------------------------------------------


async def test_a_frozen_redis_costs_no_request(
        valkey: EmbeddedValkey, start_machine: Callable[..., Awaitable[Started]],
        http: aiohttp.ClientSession) -> None:
    # SIGSTOP: connections hang rather than being refused. The router fails static.
    m = (await start_machine(valkey.url)).machine
    os.kill(valkey.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        results = await asyncio.gather(*(post(http, m.url, timeout_s=8) for _ in range(20)))
        assert [status for status, _ in results] == [200] * 20
        assert time.monotonic() - started < 8
        async with asyncio.timeout(10):
            async with http.get(f"{m.url}/health") as response:
                assert response.status == 200
    finally:
        os.kill(valkey.pid, signal.SIGCONT)


async def test_a_drain_outlives_redis_restarted_empty_under_two_processes(
        valkey: EmbeddedValkey, start_machine: Callable[..., Awaitable[Started]],
        http: aiohttp.ClientSession) -> None:
    started = await start_machine(valkey.url)
    m = started.machine
    async with http.post(f"{m.url}/admin/drain", json={"worker": "a", "reason": "t"},
                         headers=ADMIN) as response:
        assert response.status == 200

    async def both_drained() -> bool:
        return all(sample(m.own_metrics(index), "globalpool_drained", kind="worker") == 1
                   for index in (0, 1))

    await until(both_drained, 10, "the drain did not reach both processes")
    port = valkey.port
    valkey.stop()
    back = EmbeddedValkey.start(port=port, die_with_parent=True)
    try:
        client = connect(back.url)

        async def restored() -> bool:
            return bool(await client.exists(f"{started.prefix}:drains"))

        await until(restored, 10, "no process restored the drain")
        await client.aclose()
        results = await asyncio.gather(*(post(http, m.url) for _ in range(10)))
        assert [status for status, _ in results] == [200] * 10
    finally:
        back.stop()


# --- Sentinel --------------------------------------------------------------------------


@pytest.fixture
def sentinel_group(tmp_path: Path) -> Iterator[SentinelGroup]:
    group = SentinelGroup.start(tmp_path / "sentinel")
    try:
        yield group
    finally:
        group.stop()


async def test_a_sentinel_url_with_a_wrong_service_name_says_so(
        sentinel_group: SentinelGroup, start_machine: Callable[..., Awaitable[Started]],
        http: aiohttp.ClientSession) -> None:
    # Not a crash loop: both processes start, answer 503 at once (no view of the fleet),
    # are not ready, and the log names the sentinels' answer.
    wrong = sentinel_group.url.replace(f"/{sentinel_group.service}/", "/no-such-service/")
    m = (await start_machine(wrong, publish_url=sentinel_group.primary.url)).machine
    results = await asyncio.gather(*(post(http, m.url, timeout_s=10) for _ in range(6)))
    assert [status for status, _ in results] == [503] * 6, results
    async with http.get(f"{m.url}/ready") as response:
        assert response.status == 503
    text = m.log.read_text()
    assert "No master found for 'no-such-service'" in text, text[-2000:]
    assert "starting it again" not in text and m.supervisor.poll() is None


async def test_a_frozen_sentinel_primary_costs_no_request_and_a_drain_follows_the_new_one(
        sentinel_group: SentinelGroup, start_machine: Callable[..., Awaitable[Started]],
        http: aiohttp.ClientSession) -> None:
    # The primary hangs (SIGSTOP), it does not refuse: connections to it time out, the
    # sentinels promote the replica (down-after 1 s), the processes follow.
    m = (await start_machine(sentinel_group.url,
                             publish_url=sentinel_group.primary.url)).machine
    old = sentinel_group.primary
    os.kill(old.pid, signal.SIGSTOP)
    try:
        statuses: list[int] = []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            batch = await asyncio.gather(*(post(http, m.url, timeout_s=8) for _ in range(4)))
            statuses += [status for status, _ in batch]
        assert statuses and set(statuses) == {200}, statuses
        await asyncio.to_thread(sentinel_group.wait_for_new_primary, old, 20)

        async def drained() -> bool:
            async with http.post(f"{m.url}/admin/drain", json={"worker": "a", "reason": "t"},
                                 headers=ADMIN) as response:
                if response.status != 200:
                    return False
            return all(sample(m.own_metrics(index), "globalpool_drained", kind="worker") == 1
                       for index in (0, 1))

        await until(drained, 15, "a drain after the failover did not reach both processes")
        results = await asyncio.gather(*(post(http, m.url) for _ in range(6)))
        assert [status for status, _ in results] == [200] * 6
    finally:
        os.kill(old.pid, signal.SIGCONT)


# --- Cluster ---------------------------------------------------------------------------


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[ValkeyCluster]:
    group = ValkeyCluster.start(tmp_path / "cluster", primaries=3, replicas_per_primary=1)
    try:
        yield group
    finally:
        for node in group.nodes:
            with contextlib.suppress(ProcessLookupError):
                os.kill(node.pid, signal.SIGCONT)
        group.stop()


async def test_a_frozen_cluster_node_costs_no_request_and_admin_answers_in_bounded_time(
        cluster: ValkeyCluster, start_machine: Callable[..., Awaitable[Started]],
        http: aiohttp.ClientSession) -> None:
    started = await start_machine(cluster.url)
    m = started.machine
    # The node of the `{prefix}` slot (drain flags, batches) hangs.
    node = cluster.node_for_slot(key_slot(f"{{{started.prefix}}}".encode()))
    os.kill(node.pid, signal.SIGSTOP)
    try:
        results = await asyncio.gather(*(post(http, m.url, timeout_s=8) for _ in range(20)))
        assert [status for status, _ in results] == [200] * 20
        began = time.monotonic()
        async with asyncio.timeout(20):
            async with http.post(f"{m.url}/admin/drain", json={"worker": "a", "reason": "t"},
                                 headers=ADMIN) as response:
                status = response.status
        took = time.monotonic() - began
        print(f"drain with the node frozen: {status} after {took:.2f} s")
        # A Redis call is bounded (1 s socket timeout, one retry): the command fails in
        # a few seconds, it does not say it drained.
        assert status != 200 and took < 8, (status, took)
        async with asyncio.timeout(10):
            async with http.get(f"{m.url}/metrics") as response:
                assert response.status == 200
    finally:
        os.kill(node.pid, signal.SIGCONT)


def _move_slot(cluster: ValkeyCluster, slot: int) -> None:
    """Move `slot` and its keys to another primary as an operator's resharding does
    (IMPORTING / MIGRATING, MIGRATE, SETSLOT NODE): clients meet ASK, then MOVED."""
    source = cluster.node_for_slot(slot)
    target = next(node for node in cluster.primaries if node is not source)
    source_id, target_id = source.command("CLUSTER", "MYID"), target.command("CLUSTER", "MYID")
    target.command("CLUSTER", "SETSLOT", str(slot), "IMPORTING", source_id)
    source.command("CLUSTER", "SETSLOT", str(slot), "MIGRATING", target_id)
    for _ in range(100):
        keys = source.command("CLUSTER", "GETKEYSINSLOT", str(slot), "100")
        if not keys:
            break
        source.command("MIGRATE", target.host, str(target.port), "", "0", "5000", "KEYS",
                       *keys)
    for node in cluster.primaries:
        node.command("CLUSTER", "SETSLOT", str(slot), "NODE", target_id)
    assert cluster.node_for_slot(slot) is target


async def test_drains_survive_their_slot_moving_to_another_node(
        cluster: ValkeyCluster, start_machine: Callable[..., Awaitable[Started]],
        http: aiohttp.ClientSession) -> None:
    started = await start_machine(cluster.url)
    m = started.machine

    async def drain(worker: str, action: str = "drain") -> None:
        async with http.post(f"{m.url}/admin/{action}", json={"worker": worker, "reason": "t"},
                             headers=ADMIN) as response:
            assert response.status == 200, await response.text()

    async def drained(count: int) -> bool:
        return all(sample(m.own_metrics(index), "globalpool_drained", kind="worker") == count
                   for index in (0, 1))

    await drain("a")
    await until(lambda: drained(1), 10, "the drain did not reach both processes")
    await asyncio.to_thread(_move_slot, cluster, key_slot(f"{{{started.prefix}}}".encode()))
    await asyncio.sleep(1.5)  # several re-reads of the flags on the new node
    assert await drained(1), "a drain was lost when its slot moved"
    await drain("a", "undrain")
    await until(lambda: drained(0), 10, "an undrain after the move did not reach both")
    results = await asyncio.gather(*(post(http, m.url) for _ in range(10)))
    assert [status for status, _ in results] == [200] * 10
