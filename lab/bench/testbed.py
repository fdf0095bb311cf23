"""The benchmark's test bed: `LocalStack` with one router replica per region.

    client (origin R) --loopback--> router replica in R --netem(RTT R->W)--> sim in W

Every region's simulators sit behind that region's emulated network (netem) on its own
loopback address 127.0.X.1. Router replica R binds its connections to R's address
(lab.bench.router_child), and each netem adds the RTT from the connecting replica's
region, so a worker in eu-west is 80 ms away from the us-east replica and 2 ms from the
eu-west one. Clients of a region send to their region's replica (no emulated delay on that
hop: the client is in the router's region) with `x-globalpool-client-region`.

With `replicas` < the number of regions, the regions after the first `replicas` have no
router of their own and their clients use the first region's (their RTT to it is not
emulated; use this only to compare herding with fewer replicas).

Policies are switched between runs by restarting the routers with a rewritten config (a
fresh router: empty affinity table, in-flight counts and health); simulators, their
netems, agents and Valkey stay up.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from lab.bench.scenario import Scenario
from lab.devstack.children import Child, StackError, terminate
from lab.devstack.stack import LocalStack, region_address
from lab.devstack.valkey import free_port
from router.config_loader import load_config

Say = Callable[[str], None]
KEY_PREFIX = "gp-bench"
# A router between runs has nothing in flight: it exits on SIGTERM at once.
ROUTER_STOP_S = 30.0


def config_document(scenario: Scenario, policy: str, router_region: str, port: int,
                    hedge: float = 0.0) -> dict[str, Any]:
    """The regions.yaml every router replica of a run reads (each region's simulated
    engines at that region's speed); `hedge`: the share of interactive streams the
    routers may hedge (0: none)."""

    def simulated(region: str) -> dict[str, Any]:
        engine = scenario.engine_for(region)
        return {
            "max_num_seqs": engine.max_num_seqs, "kv_blocks": engine.kv_blocks,
            "block_size": engine.block_size,
            "prefill_tokens_per_s": engine.prefill_tokens_per_s,
            "decode_step_ms": engine.decode_step_ms,
            "decode_step_ms_per_seq": engine.decode_step_ms_per_seq,
        }

    timeout_s = scenario.request_timeout_s
    return {
        "apiVersion": "globalpool/v1",
        "redis": {"url": "embedded", "key_prefix": KEY_PREFIX},
        "router": {
            "region": router_region, "port": port, "policy": policy, "max_attempts": 2,
            "timeouts": {"connect_s": 2, "first_byte_s": timeout_s, "idle_s": timeout_s,
                         "total_s": 2 * timeout_s},
            "hedging": ({"classes": ["interactive"], "max_fraction": hedge} if hedge
                        else {}),
        },
        "heartbeat": {"interval_s": scenario.heartbeat_interval_s,
                      "ttl_s": max(2.0, 4 * scenario.heartbeat_interval_s)},
        "regions": {
            name: {"rtt_ms": dict(spec.rtt_ms), "models": [scenario.model],
                   "cost_per_gpu_hour": spec.cost_per_gpu_hour,
                   "simulated": {"workers": spec.workers, **simulated(name)}}
            for name, spec in scenario.regions.items()
        },
    }


class BenchStack(LocalStack):
    """LocalStack whose router replicas each see the RTTs of their own region.

    Three additions, all at process launch: routers run under lab.bench.router_child
    bound to their listening address, every netem gets `--rtt-ms-from ADDR=MS` for
    each replica's address, and every simulator the scenario's context length
    (`--max-model-len`, which regions.yaml's `simulated` block does not carry).
    """

    max_model_len = 4096  # set per test bed from the scenario's engine

    async def _spawn(self, name: str, role: str, region: str | None, args: Sequence[str],
                     ready_prefix: str, *, module: str = "router.cli",
                     env: dict[str, str] | None = None, starts: int = 1) -> Child:
        args = list(args)
        if role == "router" and module == "router.cli":
            host = args[args.index("--host") + 1]
            module, args = "lab.bench.router_child", ["--source-host", host, *args]
        elif role == "sim":
            args += ["--max-model-len", str(self.max_model_len)]
        elif role == "netem" and region is not None:
            for origin in self.router_regions:
                if origin is not None:
                    source = region_address(list(self.config.regions).index(origin))
                    args += ["--rtt-ms-from", f"{source}={self.config.rtt_ms(origin, region)}"]
        return await super()._spawn(name, role, region, args, ready_prefix, module=module,
                                    env=env, starts=starts)


class Testbed:
    """Start once, `use(policy)` before each run, `stop()` at the end."""

    def __init__(self, scenario: Scenario, out: Path, replicas: int, say: Say,
                 hedge: float = 0.0) -> None:
        regions = list(scenario.regions)
        if not 1 <= replicas <= len(regions):
            raise ValueError(f"--replicas: between 1 and {len(regions)} (one per region)")
        self.scenario = scenario
        self.router_regions = regions[:replicas]
        self.config_path = out / "regions.yaml"
        self.log_dir = out / "logs"
        self._say = say
        self._hedge = hedge
        self.stack: BenchStack | None = None
        self.policy: str | None = None
        self._unused = False  # the routers have not served a run yet
        self.stuck_routers: list[str] = []  # routers SIGKILLed when SIGTERM did not stop them

    def _write_config(self, policy: str, port: int) -> None:
        document = config_document(self.scenario, policy, self.router_regions[0], port,
                                   self._hedge)
        self.config_path.parent.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text("# written by globalpool bench\n"
                                    + yaml.safe_dump(document, sort_keys=False))

    async def start(self, policy: str) -> None:
        first = region_address(list(self.scenario.regions).index(self.router_regions[0]))
        port = free_port(first)
        self._write_config(policy, port)
        config = load_config(self.config_path)
        self.stack = BenchStack(config, self.config_path, host=first, port=port,
                                log_dir=self.log_dir, netem=True,
                                router_regions=list(self.router_regions), progress=self._say,
                                start_timeout_s=90.0)
        self.stack.max_model_len = self.scenario.engine.max_model_len
        await self.stack.start()
        self.policy = policy
        self._unused = True

    def _started(self) -> BenchStack:
        if self.stack is None:
            raise StackError("the test bed is not started")
        return self.stack

    async def use(self, policy: str) -> None:
        """Fresh router replicas running `policy` (restarted, unless they were started with
        it and have served nothing yet)."""
        stack = self._started()
        if policy == self.policy and self._unused:
            self._unused = False
            return
        self._unused = False
        routers = stack.by_role("router")
        stopped = await asyncio.gather(*(terminate(r, ROUTER_STOP_S) for r in routers))
        for router, clean in zip(routers, stopped, strict=True):
            if not clean:
                self.stuck_routers.append(router.name)
                self._say(f"    {router.name} (pid {router.pid}) did not exit within "
                          f"{ROUTER_STOP_S:g} s of SIGTERM: killed (see its log)")
        self._write_config(policy, stack.port)
        restarted = await asyncio.gather(*(stack.restart(router) for router in routers))
        workers = len(stack.by_role("sim"))
        await asyncio.gather(*(_wait_sees(str(r.url), workers, 60.0) for r in restarted))
        self.policy = policy

    @property
    def redis_url(self) -> str:
        return self._started().redis_url

    @property
    def sims(self) -> list[Child]:
        return self._started().by_role("sim")

    def router_for(self, origin: str) -> str:
        """The router URL clients of `origin` send to."""
        urls = self._started().router_urls
        return urls.get(origin) or urls[self.router_regions[0]]

    def cpu_seconds_by_role(self) -> dict[str, float]:
        """CPU time (user + system) the stack's processes used so far, summed by role
        (Linux /proc; empty elsewhere). Differences over a run show whether the machine,
        not the simulated engines, limited it."""
        used: dict[str, float] = {}
        ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        stack = self._started()
        for child in stack.children:
            used[child.role] = used.get(child.role, 0.0) + _cpu_s(child.pid, ticks)
        if stack.valkey is not None:
            used["valkey"] = _cpu_s(stack.valkey.pid, ticks)
        return used

    def exited(self) -> list[str]:
        return [child.name for child in self._started().exited()]

    async def stop(self) -> None:
        if self.stack is not None:
            await self.stack.stop(timeout_s=5.0)


def _cpu_s(pid: int, ticks_per_s: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / ticks_per_s  # utime, stime


async def _wait_sees(url: str, workers: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError):
                async with session.get(f"{url}/health",
                                       timeout=aiohttp.ClientTimeout(total=1)) as response:
                    if (await response.json()).get("workers", 0) >= workers:
                        return
            await asyncio.sleep(0.1)
    raise StackError(f"the router at {url} did not see all {workers} workers within "
                     f"{timeout_s:g} s")
