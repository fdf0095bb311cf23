"""One topology of the hostile drill: a region of healthy simulated workers and one bad
one, each beside its real worker agent heartbeating to a shared Valkey, and a router
process that is started afresh for every cell.

A lane is a `LocalStack` (lab.devstack.stack) with its own regions.yaml and key prefix,
so that lanes sharing one Valkey never see each other's workers. The last simulator is the
bad worker: a cell sets its `misbehave` knob, reads its arrivals (/sim/arrivals) and clears
the knob again. A fresh router per cell is the isolation between cells: no breaker, retry
budget, latency penalty, keep-alive pool or memory carries over, so each cell's
detection and RSS are its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from lab.devstack.children import Child, StackError, terminate
from lab.devstack.stack import LocalStack
from lab.drill.hostile.http import Endpoint
from lab.drill.run import with_overrides
from router.config_loader import load_config

REGION = "lab"
MODEL = "tiny-llama"
_HTTP_TIMEOUT = aiohttp.ClientTimeout(total=5.0)
_ROUTER_STOP_S = 2.0  # SIGTERM, then SIGKILL: the cell's clients have all gone by then
_SEES_ALL_TIMEOUT_S = 20.0
_WARM_UP_REQUESTS = 2  # per simulator
_WARM_UP_HEARTBEATS = 2.5  # intervals to wait after them


def lane_document(index: int, healthy_workers: int, port: int) -> dict[str, Any]:
    """The lane's regions.yaml: one region, `healthy_workers` + 1 simulated workers.

    Timeouts are short so that a cell of seconds sees a fault found (production's
    first_byte_s is 120 s; regions.yaml). Requests go round robin, through the same health
    filter as every policy, so that the bad worker gets its share of every cell until
    the router's health checks stop it: with `predicted_ttft`, among near-equal workers the
    better of two random ones always wins, and the one whose measured prefill rate
    happens to be the worst of four gets no request at all (a cell that never meets its
    fault). `--set router.policy=predicted_ttft` drills the production policy."""
    router: dict[str, Any] = {
        "region": REGION, "host": "127.0.0.1", "port": port, "policy": "round_robin",
        "timeouts": {"connect_s": 1, "first_byte_s": 2, "idle_s": 2, "total_s": 8},
    }
    return {
        "apiVersion": "globalpool/v1",
        "redis": {"url": "embedded", "key_prefix": f"gp-hostile-{index}"},
        "router": router,
        # (a wedged engine is found by its agent in 1 s: the `wedge` fault)
        "heartbeat": {"interval_s": 0.25, "ttl_s": 2.0, "stuck_after_s": 1.0},
        "regions": {REGION: {
            "rtt_ms": {REGION: 1}, "models": [MODEL],
            "simulated": {"workers": healthy_workers + 1, "max_num_seqs": 32,
                          "kv_blocks": 8192, "decode_step_ms": 2,
                          "decode_step_ms_per_seq": 0.05, "prefill_tokens_per_s": 50000},
        }},
    }


# The fault that is not a way of answering but an engine that runs no step (lab.sim's
# `wedge` knob): a hung accelerator, /health and /metrics answering.
WEDGE = "wedge"


class Lane:
    """`await lane.start()`, then per cell `fresh_router`, `set_fault`, ..., `stop()`."""

    def __init__(self, index: int, out: Path, redis_url: str, document: dict[str, Any],
                 overrides: Sequence[str], admin_token: str, say: Callable[[str], None]) -> None:
        """`overrides`: PATH=VALUE changes of `document` (lab.drill.run.with_overrides)."""
        self.index = index
        self.dir = out / f"lane-{index}"
        self._redis_url = redis_url
        self._document = document
        self._overrides = overrides
        self._admin_token = admin_token
        self._say = say
        self._stack: LocalStack | None = None
        self._http: aiohttp.ClientSession | None = None
        self._router_used = False

    @property
    def stack(self) -> LocalStack:
        assert self._stack is not None, "lane not started"
        return self._stack

    @property
    def router(self) -> Child:
        return self.stack.by_role("router")[0]

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(self.stack.host, self.stack.port)

    @property
    def bad_sim(self) -> Child:
        """The region's last simulator (by number: children are listed as they started)."""
        count = self.stack.config.regions[REGION].simulated.workers
        return self.stack.child(f"sim-{REGION}-{count}")

    @property
    def bad_worker_id(self) -> str:
        return self.bad_sim.name.removeprefix("sim-")

    @property
    def worker_ids(self) -> list[str]:
        return [sim.name.removeprefix("sim-") for sim in self.stack.by_role("sim")]

    async def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        written = self.dir / "regions.yaml"
        written.write_text(yaml.safe_dump(self._document, sort_keys=False))
        config_path = with_overrides(written, self._overrides, self.dir)
        config = load_config(config_path)
        self._stack = LocalStack(
            config, config_path, host=config.router.host, port=config.router.port,
            log_dir=self.dir / "logs", redis_url=self._redis_url,
            progress=lambda line: self._say(f"lane {self.index} {line}"),
            admin_token=self._admin_token)
        self._http = aiohttp.ClientSession(timeout=_HTTP_TIMEOUT)
        await self._stack.start()

    async def stop(self) -> None:
        if self._http is not None:
            await self._http.close()
        if self._stack is not None:
            await self._stack.stop(timeout_s=5.0)

    async def fresh_router(self) -> Child:
        """A router that has served nothing yet and sees every worker."""
        if self._router_used:
            await terminate(self.router, _ROUTER_STOP_S)
            await self.stack.restart(self.router)
            await self._wait_router_sees_all()
        self._router_used = True
        return self.router

    async def _wait_router_sees_all(self) -> None:
        url = f"{self.router.url}/health"
        wanted = len(self.worker_ids)
        deadline = time.monotonic() + _SEES_ALL_TIMEOUT_S
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError):
                if (await self._get_json(url)).get("workers", 0) >= wanted:
                    return
            await asyncio.sleep(0.05)
        raise StackError(f"lane {self.index}: the restarted router did not see its {wanted} "
                         f"workers within {_SEES_ALL_TIMEOUT_S:g} s; see {self.stack.log_dir}")

    async def warm_up(self) -> None:
        """A few requests straight to every simulator, then time for a heartbeat or two:
        every worker then reports a recent TTFT, as a worker that has been serving does.
        (Without it the bad worker, idle since the last cell, reports none, scores worse
        than the others and would see little of the cell's traffic.)"""
        body = {"model": MODEL, "max_tokens": 4,
                "messages": [{"role": "user", "content": "warm up"}]}

        async def post(url: str) -> None:
            assert self._http is not None
            async with self._http.post(f"{url}/v1/chat/completions", json=body) as response:
                await response.read()

        await asyncio.gather(*(post(str(sim.url)) for sim in self.stack.by_role("sim")
                               for _ in range(_WARM_UP_REQUESTS)))
        await asyncio.sleep(_WARM_UP_HEARTBEATS * self.stack.config.heartbeat.interval_s)

    async def set_fault(self, mode: str, **knobs: Any) -> None:
        """The bad worker's fault: a `misbehave` mode, `wedge` (its engine takes requests
        in, counts them and runs no step), or `none`."""
        wedge = mode == WEDGE
        await self.stack.set_sim_faults(self.bad_sim, misbehave="none" if wedge else mode,
                                        wedge=wedge, **knobs)

    async def arrivals(self) -> dict[str, Any]:
        """The bad worker's GET /sim/arrivals (since its knobs last changed)."""
        return await self._get_json(f"{self.bad_sim.url}/sim/arrivals")

    async def router_events(self) -> list[dict[str, Any]]:
        """The router's recent events (/admin/status), each with `at_unix_s`."""
        status = await self._get_json(f"{self.router.url}/admin/status?workers=0",
                                      {"Authorization": f"Bearer {self._admin_token}"})
        events: list[dict[str, Any]] = status.get("events", [])
        return events

    def router_memory_mb(self) -> tuple[float, float]:
        """The router's resident set now and at its peak (VmRSS, VmHWM), in MB."""
        fields: dict[str, float] = {}
        text = Path(f"/proc/{self.router.pid}/status").read_text()
        for line in text.splitlines():
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                fields[name] = int(value.split()[0]) / 1024
        return round(fields["VmRSS"], 1), round(fields["VmHWM"], 1)

    async def _get_json(self, url: str, headers: Mapping[str, str] | None = None
                        ) -> dict[str, Any]:
        assert self._http is not None
        async with self._http.get(url, headers=headers) as response:
            if response.status != 200:
                raise StackError(f"GET {url} -> {response.status}: {await response.text()}")
            document: dict[str, Any] = await response.json()
            return document
