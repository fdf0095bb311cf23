"""A fleet for the operators' tests: real router apps (from a regions.yaml file) in front of
real simulators, with heartbeats the test publishes, a real Valkey, all on loopback."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from aiohttp import web
from opentelemetry.trace import TracerProvider
from prometheus_client.parser import text_string_to_metric_families

from lab.devstack.valkey import free_port
from lab.sim.server import SimServer
from router.app import HOLDER, RouterSettings, build_app, router_site
from router.config_loader import load_config
from tests.integration.conftest import StartSim
from worker.heartbeat_keys import HeartbeatKeys
from worker.publisher import HeartbeatPublisher
from worker.redis_client import connect
from worker.schema import Capacity, Heartbeat, LifecycleState, Load, Performance

TOKEN = "test-admin-token-7f3a"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4}


def fleet_config(redis_url: str, key_prefix: str, **router: Any) -> dict[str, Any]:
    return {
        "apiVersion": "globalpool/v1",
        "redis": {"url": redis_url, "key_prefix": key_prefix},
        "router": {"region": "us-east", "near_equal_ms": 0.5,
                   "timeouts": {"connect_s": 1, "first_byte_s": 5, "idle_s": 5, "total_s": 20},
                   **router},
        "admin": {"config_check_s": 0.1},
        "heartbeat": {"insecure": True},  # the fleet publishes unsigned heartbeats
        "regions": {
            "us-east": {"rtt_ms": {"eu-west": 80}, "models": ["m"]},
            "eu-west": {"models": ["m"]},
        },
    }


@dataclass
class OpsFleet:
    redis_url: str
    key_prefix: str
    tmp_path: Path
    start_sim: StartSim
    sims: dict[str, SimServer] = field(default_factory=dict)
    regions: dict[str, str] = field(default_factory=dict)
    endpoints: dict[str, str] = field(default_factory=dict)  # advertise these instead of sims
    runners: list[web.AppRunner] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)
    apps: list[web.Application] = field(default_factory=list)
    _publisher: HeartbeatPublisher | None = None
    _seq: int = 0

    @property
    def config_path(self) -> Path:
        return self.tmp_path / "regions.yaml"

    @property
    def url(self) -> str:
        return self.urls[0]

    def write_config(self, document: Mapping[str, Any]) -> None:
        # Write then rename, as editors and ConfigMaps do: never a half-written file.
        partial = self.config_path.with_suffix(".partial")
        partial.write_text(yaml.safe_dump(dict(document)))
        partial.replace(self.config_path)

    async def start(self, workers: Mapping[str, str], *, replicas: int = 1,
                    config: Mapping[str, Any] | None = None,
                    tracer_provider: TracerProvider | None = None,
                    replica_regions: tuple[str, ...] = (),
                    **sim_changes: Any) -> None:
        """`replicas` router apps (in the regions `replica_regions` names, in order; else
        us-east) in front of one simulator per worker."""
        self._publisher = HeartbeatPublisher(connect(self.redis_url),
                                             HeartbeatKeys(self.key_prefix))
        for index, (worker_id, region) in enumerate(workers.items()):
            self.sims[worker_id] = await self.start_sim(served_model_names=("m",), seed=index,
                                                        **sim_changes)
            self.regions[worker_id] = region
            await self.publish(worker_id)
        self.write_config(config or fleet_config(self.redis_url, self.key_prefix))
        for number in range(replicas):
            settings = RouterSettings(
                config=load_config(self.config_path), redis_url=self.redis_url,
                region=replica_regions[number] if replica_regions else "us-east", seed=1,
                config_path=self.config_path,
                tracer_provider=tracer_provider)
            app = build_app(settings)
            runner = web.AppRunner(app, handler_cancellation=True)
            await runner.setup()
            port = free_port()
            await router_site(runner, "127.0.0.1", port).start()
            self.runners.append(runner)
            self.apps.append(app)
            self.urls.append(f"http://127.0.0.1:{port}")
            deadline = time.monotonic() + 10
            while len(app[HOLDER].current.workers) < len(workers):
                assert time.monotonic() < deadline, "router never saw the heartbeats"
                await asyncio.sleep(0.02)

    async def publish(self, worker_id: str, *, running: int = 0,
                      state: LifecycleState = LifecycleState.READY,
                      max_num_seqs: int = 8, performance: Performance | None = None) -> None:
        assert self._publisher is not None
        self._seq += 1
        await self._publisher.publish(Heartbeat(
            worker_id=worker_id, region=self.regions[worker_id],
            endpoint=self.endpoints.get(worker_id, self.sims[worker_id].url), models=("m",),
            state=state,
            capacity=Capacity(max_num_seqs=max_num_seqs),
            load=Load(running=running, waiting=0, kv_cache_usage=0.1),
            performance=performance or Performance(), seq=self._seq, sent_at_s=time.time(),
            ttl_s=60.0,
        ))

    async def close(self) -> None:
        """Stop the routers (idempotent)."""
        runners, self.runners = self.runners, []
        for runner in runners:
            await runner.cleanup()
        if self._publisher is not None:
            await self._publisher.aclose()
            self._publisher = None


def auth(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def chat(url: str, body: Mapping[str, Any] = CHAT,
               headers: Mapping[str, str] | None = None) -> tuple[int, str, bytes]:
    async with aiohttp.ClientSession() as session, session.post(
        f"{url}/v1/chat/completions", json=dict(body), headers=dict(headers or {})
    ) as response:
        return (response.status, response.headers.get("x-globalpool-region", ""),
                await response.read())


async def post(url: str, body: Mapping[str, Any], headers: Mapping[str, str] | None = None
               ) -> tuple[int, Mapping[str, str], bytes]:
    """POST a chat completion: its status, headers and whole body."""
    async with aiohttp.ClientSession() as session, session.post(
            f"{url}/v1/chat/completions", json=dict(body), headers=dict(headers or {})
    ) as response:
        return response.status, response.headers, await response.read()


async def admin(url: str, method: str, path: str, *, token: str | None = TOKEN,
                body: Mapping[str, Any] | None = None) -> tuple[int, Any]:
    headers = auth(token) if token is not None else {}
    async with aiohttp.ClientSession() as session, session.request(
        method, f"{url}{path}", json=dict(body) if body is not None else None, headers=headers
    ) as response:
        return response.status, await response.json()


async def wait_for(predicate: Any, timeout_s: float = 10.0, interval_s: float = 0.05) -> float:
    """Await `predicate()` (sync or async) until true; returns the seconds it took."""
    started = time.monotonic()
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return time.monotonic() - started
        assert time.monotonic() - started < timeout_s, "condition not met in time"
        await asyncio.sleep(interval_s)


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(url: str) -> Samples:
    """The router's /metrics, parsed: (sample name, sorted labels) -> value."""
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = await response.text()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: Samples, metric: str, **labels: str) -> float:
    """The sum over samples of `metric` whose labels include `labels`."""
    return sum(v for (n, ls), v in samples.items()
               if n == metric and set(labels.items()) <= set(ls))
