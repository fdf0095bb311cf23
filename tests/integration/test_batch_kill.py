"""A batch shared by two router replicas (real `globalpool router` processes), one of which
is SIGKILLed twice in the middle of it: no line is lost, none appears twice in the
output, and the lines run more than once are counted (router.batch.state)."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import yaml
from openai import AsyncOpenAI

from lab.devstack.valkey import free_port
from router.batch.state import BatchStore
from tests.integration.conftest import StartSim
from worker.heartbeat_keys import HeartbeatKeys
from worker.publisher import HeartbeatPublisher
from worker.redis_client import connect
from worker.schema import Capacity, Heartbeat, LifecycleState, Load

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
LINES = 480
LEASE_S = 2


class Replica:
    """One `globalpool router` process, which the test may SIGKILL and start again."""

    def __init__(self, config: Path, log: Path, port: int) -> None:
        self.config, self.log, self.port = config, log, port
        self.process: subprocess.Popen[bytes] | None = None
        self.url = f"http://127.0.0.1:{port}"

    async def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GLOBALPOOL_")}
        env["GLOBALPOOL_ROUTER_PROCESSES"] = "1"
        before = self.log.read_text() if self.log.exists() else ""
        self.process = _spawn(["router", "--config", str(self.config), "--port",
                               str(self.port)], self.log, env)
        deadline = time.monotonic() + 60
        while self.log.read_text().count("router listening on") <= before.count(
                "router listening on"):
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            assert time.monotonic() < deadline, self.log.read_text()[-3000:]
            await asyncio.sleep(0.05)

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def _spawn(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", "router.cli", *args], cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)


@pytest.fixture
async def replicas(redis_url: str, tmp_path: Path, start_sim: StartSim
                   ) -> AsyncIterator[tuple[Replica, Replica, str]]:
    prefix = f"gptest-{uuid.uuid4().hex[:10]}"
    publisher = HeartbeatPublisher(connect(redis_url), HeartbeatKeys(prefix))
    for index, worker_id in enumerate(("a", "b")):
        # ~0.4 s an answer (40 tokens of 10 ms), 12 batch slots each.
        sim = await start_sim(served_model_names=("m",), seed=index, decode_step_ms=10.0)
        await publisher.publish(Heartbeat(
            worker_id=worker_id, region="us-east", endpoint=sim.url, models=("m",),
            state=LifecycleState.READY, capacity=Capacity(max_num_seqs=16),
            load=Load(running=0, waiting=0, kv_cache_usage=0.0), seq=1,
            sent_at_s=time.time(), ttl_s=600.0))
    config = tmp_path / "regions.yaml"
    config.write_text(yaml.safe_dump({
        "apiVersion": "globalpool/v1",
        "redis": {"url": redis_url, "key_prefix": prefix},
        "router": {"region": "us-east", "host": "127.0.0.1"},
        "heartbeat": {"insecure": True},  # the test publishes unsigned heartbeats
        "batch": {"storage": f"file://{tmp_path}/files", "lease_s": LEASE_S},
        "regions": {"us-east": {"models": ["m"]}},
    }))
    pair = (Replica(config, tmp_path / "first.log", free_port()),
            Replica(config, tmp_path / "second.log", free_port()))
    try:
        await asyncio.gather(*(replica.start() for replica in pair))
        yield pair[0], pair[1], prefix
    finally:
        for replica in pair:
            replica.stop()
        await publisher.aclose()


@pytest.mark.slow(why="two replicas, one SIGKILLed twice mid-batch (~15 s)")
async def test_a_replica_killed_twice_mid_batch_loses_and_doubles_nothing(
        replicas: tuple[Replica, Replica, str], redis_url: str) -> None:
    first, second, prefix = replicas
    rows = [json.dumps({"custom_id": f"req-{i}", "method": "POST",
                        "url": "/v1/chat/completions",
                        "body": {"model": "m", "max_tokens": 40,
                                 "messages": [{"role": "user", "content": f"line {i}"}]}})
            for i in range(LINES)]
    async with AsyncOpenAI(base_url=first.url + "/v1", api_key="unused",
                           max_retries=0) as openai:
        uploaded = await openai.files.create(
            file=("input.jsonl", io.BytesIO("\n".join(rows).encode())), purpose="batch")
        batch = await openai.batches.create(input_file_id=uploaded.id,
                                            endpoint="/v1/chat/completions",
                                            completion_window="24h")
        kills: list[int] = []
        deadline = time.monotonic() + 240
        while True:
            now = await openai.batches.retrieve(batch.id)
            if now.status in ("completed", "failed", "expired", "cancelled"):
                break
            assert time.monotonic() < deadline, now
            counts = now.request_counts
            done = 0 if counts is None else counts.completed + counts.failed
            if len(kills) < 2 and done >= LINES * (0.2 + 0.35 * len(kills)):
                second.kill()  # mid-batch: it holds leases and has lines in flight
                kills.append(done)
                await second.start()
            await asyncio.sleep(0.2)
        assert now.status == "completed", now
        content = await openai.files.content(now.output_file_id or "")
        output = [json.loads(line) for line in content.text.splitlines() if line]
        assert now.error_file_id is None
    ids = [line["custom_id"] for line in output]
    assert len(kills) == 2 and kills[1] < LINES, "both kills came mid-batch"
    assert len(ids) == len(set(ids)), "no custom_id twice in the output"
    assert sorted(ids) == sorted(f"req-{i}" for i in range(LINES)), "no line lost"
    redis = connect(redis_url)
    stored = await BatchStore(redis, prefix).get(batch.id, any_owner=True)
    await redis.aclose()
    assert stored is not None
    takeovers, reruns = stored.count("takeovers"), stored.count("reruns")
    # A killed replica's chunks are taken over when their leases end (16 lines each); the
    # lines it had finished but not recorded are run again, counted.
    assert takeovers >= 1, "the killed replica's leases were taken over"
    assert reruns <= takeovers * 16
    print(f"\nkilled at {kills} of {LINES} lines done; chunks taken over: {takeovers}; "
          f"lines run twice: {reruns}")
