"""Secure by default: what a user gets from `globalpool up` without reading the security
section already refuses forged heartbeats, and the insecure mode is an explicit opt-out.

`globalpool up` as a user runs it; the attacker can write to its Redis (the embedded
Valkey, no password) and tries every way to steer traffic to a server of its own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import yaml
from aiohttp import web

from lab.devstack.valkey import free_port
from tests.integration.operators_fleet import scrape, value
from tests.integration.stack import RunningUp, pid_alive, start_up
from worker.heartbeat_keys import HeartbeatKeys
from worker.redis_client import connect
from worker.schema import Capacity, Heartbeat, LifecycleState, Load
from worker.signing import HeartbeatSigner

pytestmark = pytest.mark.integration

CHAT = {"model": "tiny-llama", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
FROM_US_EAST = {"x-globalpool-client-region": "us-east"}


def _config(tmp_path: Path, **heartbeat: object) -> Path:
    simulated = {"workers": 1, "max_num_seqs": 4, "decode_step_ms": 5}
    path = tmp_path / "regions.yaml"
    path.write_text(yaml.safe_dump({
        "apiVersion": "globalpool/v1",
        "redis": {"url": "embedded", "key_prefix": f"gp-{tmp_path.name[-12:]}"},
        "router": {"region": "us-east", "host": "127.0.0.1", "port": free_port()},
        "heartbeat": {"interval_s": 0.25, "ttl_s": 2.0, **heartbeat},
        "regions": {
            # The only real worker is far away: a believed us-east worker would win.
            "us-east": {"rtt_ms": {"eu-west": 80}, "models": ["tiny-llama"],
                        "simulated": {**simulated, "workers": 0}},
            "eu-west": {"models": ["tiny-llama"], "simulated": simulated},
        },
    }))
    return path


@pytest.fixture
def up(tmp_path: Path) -> Iterator[RunningUp]:
    running = start_up(tmp_path, _config(tmp_path))
    try:
        yield running
    finally:
        assert running.stop() == 0, running.output()
        assert [pid for pid in running.all_pids() if pid_alive(pid)] == []


class Trap:
    """A server an attacker would like traffic sent to: it records what reaches it."""

    def __init__(self) -> None:
        self.requests = 0

    async def start(self, host: str = "127.0.0.1") -> tuple[str, web.AppRunner]:
        async def answer(_request: web.Request) -> web.Response:
            self.requests += 1
            return web.json_response({"choices": [{"message": {"content": "stolen"}}]})

        app = web.Application()
        app.router.add_post("/v1/chat/completions", answer)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port(host)
        await web.TCPSite(runner, host, port).start()
        return f"http://{host}:{port}", runner


def _forged(worker_id: str, endpoint: str, **changes: object) -> Heartbeat:
    return Heartbeat(
        worker_id=worker_id, region="us-east", endpoint=endpoint, models=("tiny-llama",),
        state=LifecycleState.READY, capacity=Capacity(max_num_seqs=64),
        load=Load(running=0, waiting=0, kv_cache_usage=0.0), seq=1, sent_at_s=time.time(),
        ttl_s=60.0).model_copy(update=changes)


async def test_a_forged_heartbeat_gets_no_request_from_the_default_up(up: RunningUp) -> None:
    trap = Trap()
    url, runner = await trap.start()
    redis = connect(up.state["redis_url"])
    keys = HeartbeatKeys(up.state["key_prefix"])
    try:
        forged = {
            "unsigned": _forged("f-unsigned", url),
            "guessed key": HeartbeatSigner("up-guess", b"a-guessed-secret-of-32-bytes!!!!")
            .sign(_forged("f-guess", url)),
            "public address": _forged("f-public", "http://93.184.216.34:8000"),
            "unlisted model": _forged("f-model", url, models=("tiny-llama", "not-listed")),
        }
        for _ in range(3):  # forged heartbeats keep coming while traffic flows
            for heartbeat in forged.values():
                payload = heartbeat.to_json()
                await redis.set(keys.worker(heartbeat.worker_id), payload, px=60_000)
                await redis.publish(keys.channel, payload)
            async with aiohttp.ClientSession() as session:
                for _ in range(10):
                    async with session.post(f"{up.url}/v1/chat/completions", json=CHAT,
                                            headers=FROM_US_EAST) as reply:
                        assert reply.status == 200, await reply.text()
                        assert reply.headers["x-globalpool-worker"] == "eu-west-1"
            await asyncio.sleep(0.3)
    finally:
        await redis.aclose()
        await runner.cleanup()
    assert trap.requests == 0
    samples = await scrape(up.url)
    assert value(samples, "globalpool_heartbeats_dropped_total") >= 3 * len(forged)
    for reason in ("unknown_key", "endpoint_not_allowed", "model_not_listed", "unsigned"):
        assert value(samples, "globalpool_heartbeats_dropped_total", reason=reason) >= 1, reason
