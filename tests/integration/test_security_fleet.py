"""A harness for the security tests: router replicas in front of real simulators, with
API keys, tenants and signed heartbeats, on a real Valkey. (No tests in this module.)

The test plays the worker agents' part by publishing heartbeats itself (signed or not),
so it controls exactly what the routers are told, as test_proxy.py does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from lab.devstack.valkey import free_port
from lab.sim.server import SimServer
from router.app import HOLDER, SECURITY_STATS, RouterSettings, build_app, router_site
from router.auth.keys import hash_key
from router.config_loader import parse_config
from router.core.stats import SecurityStats
from tests.integration.conftest import StartSim
from worker.heartbeat_keys import HeartbeatKeys
from worker.publisher import HeartbeatPublisher
from worker.redis_client import connect
from worker.schema import Capacity, Heartbeat, LifecycleState, Load
from worker.signing import HeartbeatSigner

API_KEYS = {
    "acme": "gp-test-acme-0123456789",
    "euco": "gp-test-euco-0123456789",
    "small": "gp-test-small-0123456789",
    "modelless": "gp-test-modelless-0123456789",
}
SIGNING_KEYS = {"kid-a": b"heartbeat-secret-aaaaaaaa", "kid-b": b"heartbeat-secret-bbbbbbbb"}
CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "Hello there"}],
                        "max_tokens": 4}


def auth_section(**tenant_changes: dict[str, Any]) -> dict[str, Any]:
    """Four tenants, one key each: acme (anything), euco (eu-west only), small (3 requests
    a minute per key), modelless (only a model nobody serves)."""
    tenants: dict[str, dict[str, Any]] = {
        "acme": {},
        "euco": {"allowed_regions": ["eu-west"]},
        "small": {"key_limits": {"requests_per_min": 3}},
        "modelless": {"allowed_models": ["other"]},
    }
    for name, changes in tenant_changes.items():
        tenants[name] = {**tenants.get(name, {}), **changes}
    keys = [{"id": f"{name}-key", "tenant": name, "sha256": hash_key(API_KEYS[name])}
            for name in tenants if name in API_KEYS]
    # Tests check where limits were decided: give Redis time to answer on a loaded
    # machine (the 75 ms default is tested on its own, in tests/unit/test_ratelimit.py).
    return {"tenants": tenants, "keys": keys, "rate_limits": {"redis_timeout_ms": 1000}}


def bearer(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEYS[tenant]}"}


@dataclass
class SecureFleet:
    urls: list[str]
    apps: list[web.Application]
    sims: dict[str, SimServer]
    regions: dict[str, str]
    publish: Callable[..., Awaitable[None]]
    publish_heartbeat: Callable[[Heartbeat], Awaitable[None]]
    redis_url: str
    key_prefix: str
    session: aiohttp.ClientSession = field(repr=False)

    def stats(self, replica: int = 0) -> SecurityStats:
        return self.apps[replica][SECURITY_STATS]

    def known_workers(self, replica: int = 0) -> set[str]:
        return set(self.apps[replica][HOLDER].current.workers)

    async def post(
        self, path: str, body: Any, *, tenant: str | None = None, replica: int = 0,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[int, Mapping[str, str], bytes]:
        sent = {**(bearer(tenant) if tenant else {}), **(headers or {})}
        async with self.session.post(f"{self.urls[replica]}{path}", json=body,
                                     headers=sent) as response:
            return response.status, response.headers, await response.read()

    async def chat(self, tenant: str | None, body: Any = None, *, replica: int = 0,
                   headers: Mapping[str, str] | None = None,
                   ) -> tuple[int, Mapping[str, str], bytes]:
        return await self.post("/v1/chat/completions", CHAT if body is None else body,
                               tenant=tenant, replica=replica, headers=headers)

    async def served(self, worker_id: str) -> int:
        """Requests the simulator behind `worker_id` has finished."""
        async with self.session.get(f"{self.sims[worker_id].url}/metrics") as response:
            text = await response.text()
        return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("vllm:request_success_total{")))


FleetFactory = Callable[..., Awaitable[SecureFleet]]


def next_seq() -> int:
    return next(_SEQ)


_SEQ = iter(range(10_000_000, 20_000_000))


def heartbeat_for(worker_id: str, region: str, endpoint: str, seq: int,
                  state: LifecycleState = LifecycleState.READY, ttl_s: float = 60.0,
                  sent_at_s: float | None = None) -> Heartbeat:
    return Heartbeat(
        worker_id=worker_id, region=region, endpoint=endpoint, models=("m",), state=state,
        capacity=Capacity(max_num_seqs=8), load=Load(running=0, waiting=0, kv_cache_usage=0.0),
        seq=seq, sent_at_s=time.time() if sent_at_s is None else sent_at_s, ttl_s=ttl_s,
    )


@pytest.fixture
async def secure_fleet(
    redis_url: str, key_prefix: str, start_sim: StartSim
) -> AsyncIterator[FleetFactory]:
    runners: list[web.AppRunner] = []
    publishers: dict[str, HeartbeatPublisher] = {}
    session = aiohttp.ClientSession()
    seq = iter(range(1, 1_000_000))

    def publisher_for(url: str) -> HeartbeatPublisher:
        if url not in publishers:
            publishers[url] = HeartbeatPublisher(connect(url), HeartbeatKeys(key_prefix),
                                                 signer=None)
        return publishers[url]

    async def make(
        workers: dict[str, str],
        *,
        auth: dict[str, Any] | None = None,
        replicas: int = 1,
        router_keys: Mapping[str, bytes] | None = None,
        signer: HeartbeatSigner | None = None,
        redis: str = redis_url,
        regions: dict[str, dict[str, Any]] | None = None,
        router: dict[str, Any] | None = None,
        timeouts: dict[str, float] | None = None,
    ) -> SecureFleet:
        sims = {worker_id: await start_sim(served_model_names=("m",), seed=index)
                for index, worker_id in enumerate(workers)}

        async def publish(worker_id: str, *, state: LifecycleState = LifecycleState.READY,
                          using: HeartbeatSigner | None = signer) -> None:
            heartbeat = heartbeat_for(worker_id, workers[worker_id], sims[worker_id].url,
                                      next(seq), state)
            await publisher_for(redis).publish(
                using.sign(heartbeat) if using is not None else heartbeat)

        async def publish_heartbeat(heartbeat: Heartbeat) -> None:
            await publisher_for(redis).publish(heartbeat)

        for worker_id in workers:
            await publish(worker_id)
        region_config: dict[str, dict[str, Any]] = {
            "us-east": {"rtt_ms": {"eu-west": 80}, "models": ["m"]},
            "eu-west": {"models": ["m"]},
        }
        for name, changes in (regions or {}).items():
            region_config[name] = {**region_config[name], **changes}
        config = parse_config({
            "apiVersion": "globalpool/v1",
            "redis": {"url": redis, "key_prefix": key_prefix},
            "router": {"region": "us-east", "near_equal_ms": 0.5,
                       "timeouts": timeouts or {"connect_s": 1, "first_byte_s": 5,
                                                "idle_s": 5, "total_s": 10},
                       **(router or {})},
            "regions": region_config,
            "auth": auth_section() if auth is None else auth,
            # Without router keys the fleet's heartbeats are unsigned: the explicit opt-out.
            "heartbeat": {"insecure": not router_keys},
        })
        apps: list[web.Application] = []
        urls: list[str] = []
        for replica in range(replicas):
            app = build_app(RouterSettings(config=config, redis_url=redis, region="us-east",
                                           seed=replica, heartbeat_keys=router_keys or {}))
            runner = web.AppRunner(app, handler_cancellation=True)
            await runner.setup()
            port = free_port()
            await router_site(runner, "127.0.0.1", port).start()
            runners.append(runner)
            apps.append(app)
            urls.append(f"http://127.0.0.1:{port}")
        return SecureFleet(urls, apps, sims, dict(workers), publish, publish_heartbeat, redis,
                           key_prefix, session)

    yield make
    for runner in runners:
        await runner.cleanup()
    for publisher in publishers.values():
        await publisher.aclose()
    await session.close()


async def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)
