"""The whole system on one machine: Valkey, simulated regional pools, worker agents, routers.

Each simulated region gets its own loopback address (127.0.X.1); every child is a real
process with a known PID whose logs go to `log_dir`. `LocalStack` is used by
`globalpool up`, by `globalpool drill` and by the integration tests alike.

Options beyond `up`'s defaults:
- `netem=True`: one emulated-network process per region (lab.devstack.netem) between
  the routers and that region's simulators, adding the region's RTT from the router's
  region; worker agents then advertise the netem port (`--advertise-url`), so routers
  reach engines only through it, while agents probe their engine directly.
- `router_regions`: one router replica per listed region, each started with `--region`
  and listening on that region's loopback address (the first on `host:port`).
- `admin_token`: given to the routers in the environment variable the config names
  (`admin.token_env`), so that the admin API is on.

Faults for drills are methods: kill, drain (SIGTERM) or restart processes, set a
simulator's fault knobs, partition or slow a region's network, stop/start/freeze Valkey.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from lab.devstack.children import Child, StackError, close, spawn, terminate
from lab.devstack.valkey import EmbeddedValkey, free_port
from router.config import GlobalConfig
from worker.redis_client import redact_url
from worker.signing import KEYS_ENV, KEYS_FILE_ENV

__all__ = ["Child", "LocalStack", "StackError", "region_address"]

Progress = Callable[[str], None]
_HTTP_TIMEOUT = aiohttp.ClientTimeout(total=3)


def region_address(index: int) -> str:
    """Loopback address of the `index`-th region (0-based): 127.0.1.1, 127.0.2.1, ..."""
    return f"127.0.{index + 1}.1"


class LocalStack:
    """Start with `await stack.start()`, stop with `await stack.stop()` (idempotent)."""

    def __init__(
        self,
        config: GlobalConfig,
        config_path: Path,
        *,
        host: str,
        port: int,
        log_dir: Path,
        redis_url: str | None = None,
        key_prefix: str | None = None,
        progress: Progress = lambda _line: None,
        start_timeout_s: float = 30.0,
        python: str = sys.executable,
        netem: bool = False,
        router_regions: Sequence[str | None] | None = None,
        admin_token: str | None = None,
    ) -> None:
        self.config = config
        self.config_path = config_path
        self.host = host
        self.port = port
        self.log_dir = log_dir
        self.key_prefix = key_prefix or config.redis.key_prefix
        self.netem = netem
        self.router_regions: list[str | None] = list(
            router_regions if router_regions else [config.router.region])
        self.admin_token = admin_token
        # Heartbeats are signed: the agents and routers this stack starts share a key it
        # makes (unless the environment names keys already, which they then inherit).
        self.signing_env: dict[str, str] = (
            {} if os.environ.get(KEYS_ENV) or os.environ.get(KEYS_FILE_ENV)
            else {KEYS_ENV: f"up-{secrets.token_hex(3)}:{secrets.token_urlsafe(32)}"})
        self._redis_url = redis_url
        self._progress = progress
        self._timeout_s = start_timeout_s
        self._python = python
        self.valkey: EmbeddedValkey | None = None
        self._valkey_frozen = False
        self.children: list[Child] = []
        self._steps_done = 0
        sims = sum(r.simulated.workers for r in config.regions.values())
        netems = sum(1 for r in config.regions.values() if r.simulated.workers) if netem else 0
        self.steps_total = 1 + 2 * sims + netems + len(self.router_regions)

    # --- where things are -------------------------------------------------------------
    @property
    def redis_url(self) -> str:
        if self._redis_url is not None:
            return self._redis_url
        assert self.valkey is not None, "stack not started"
        return self.valkey.url

    @property
    def router_url(self) -> str:
        """The first router replica (the only one unless `router_regions` names more)."""
        return f"http://{self.host}:{self.port}"

    @property
    def router_urls(self) -> dict[str | None, str]:
        """Each router replica's URL by its region."""
        return {child.region: str(child.url) for child in self.by_role("router")}

    def by_role(self, role: str, region: str | None = None) -> list[Child]:
        return [c for c in self.children
                if c.role == role and (region is None or c.region == region)]

    def child(self, name: str) -> Child:
        for child in self.children:
            if child.name == name:
                return child
        raise KeyError(f"no child named {name!r}")

    def _region_index(self, region: str) -> int:
        return list(self.config.regions).index(region)

    def _step(self, line: str) -> None:
        self._steps_done += 1
        width = len(str(self.steps_total))
        self._progress(f"[{self._steps_done:>{width}}/{self.steps_total}] {line}")

    # --- start and stop ---------------------------------------------------------------
    async def start(self) -> None:
        """Bring every part up in dependency order; on any failure stop what started."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> None:
        # Before anything starts: a taken port would otherwise be found only when the
        # router, the last part, fails to listen (~10 s on).
        try:
            _check_port_free(self.host, self.port)
        except OSError as exc:
            raise StackError(f"the router cannot listen on {self.host}:{self.port}: "
                             f"{exc.strerror or exc} (another process has it? set "
                             "router.port in regions.yaml or pass --port)") from exc
        if self._redis_url is None:
            # Not the router's port: it is taken only once the router starts, after Valkey.
            self.valkey = await asyncio.to_thread(
                EmbeddedValkey.start, die_with_parent=True, log_path=self.log_dir / "valkey.log",
                avoid_ports=(self.port,))
            self._step(f"valkey      {self.valkey.url} (pid {self.valkey.pid})")
        else:
            self._step(f"redis       {redact_url(self.redis_url)} (external)")
        sims = [
            self._start_sim(region, index, number)
            for index, (region, spec) in enumerate(self.config.regions.items())
            for number in range(1, spec.simulated.workers + 1)
        ]
        for sim in await asyncio.gather(*sims):
            self._step(f"sim         {sim.name:<14} {sim.url} (pid {sim.pid})")
        if self.netem:
            for netem in await asyncio.gather(*(self._start_netem(region)
                                                for region in self.config.regions
                                                if self.by_role("sim", region))):
                self._step(f"netem       {netem.region:<14} {netem.url} (pid {netem.pid})")
        sim_children = self.by_role("sim")
        workers = await asyncio.gather(*(self._start_worker(sim) for sim in sim_children))
        for worker in workers:
            self._step(f"worker      {worker.name:<14} -> {redact_url(self.redis_url)} "
                       f"(pid {worker.pid})")
        for number, region in enumerate(self.router_regions):
            router = await self._start_router(region, number)
            await self._wait_router_sees(str(router.url), len(sim_children))
            self._step(f"router      {region or '-':<14} {router.url} (pid {router.pid})")

    async def _spawn(self, name: str, role: str, region: str | None, args: Sequence[str],
                     ready_prefix: str, *, module: str = "router.cli",
                     env: dict[str, str] | None = None, starts: int = 1) -> Child:
        child = await spawn(
            name=name, role=role, region=region, module=module, args=args,
            ready_prefix=ready_prefix, log_path=self.log_dir / f"{name}.log",
            python=self._python, timeout_s=self._timeout_s, env=env, starts=starts,
        )
        self.children.append(child)
        return child

    async def _start_sim(self, region: str, index: int, number: int) -> Child:
        spec = self.config.regions[region]
        sim = spec.simulated
        args = [
            "sim", "--host", region_address(index), "--port", "0",
            "--served-model-name", *spec.models,
            "--max-num-seqs", str(sim.max_num_seqs),
            "--kv-blocks", str(sim.kv_blocks),
            "--block-size", str(sim.block_size),
            "--prefill-tokens-per-s", str(sim.prefill_tokens_per_s),
            "--decode-step-ms", str(sim.decode_step_ms),
            "--decode-step-ms-per-seq", str(sim.decode_step_ms_per_seq),
            "--max-model-len", str(sim.max_model_len),
            "--seed", str(index * 100 + number),
        ]
        child = await self._spawn(f"sim-{region}-{number}", "sim", region, args, "sim listening")
        assert child.url is not None
        # A restart must come back on the same port: the agent and netem point at it.
        child.args[child.args.index("--port") + 1] = child.url.rsplit(":", 1)[1]
        child.advertise_url = child.url
        return child

    def _network_rtt_ms(self, region: str) -> float:
        """The emulated RTT from the (first) router's region to `region`."""
        origin = self.router_regions[0]
        return 0.0 if origin is None else self.config.rtt_ms(origin, region)

    async def _start_netem(self, region: str) -> Child:
        sims = self.by_role("sim", region)
        args = ["--listen-host", region_address(self._region_index(region)),
                "--rtt-ms", str(self._network_rtt_ms(region))]
        for sim in sims:
            assert sim.url is not None
            args += ["--upstream", sim.url.removeprefix("http://")]
        netem = await self._spawn(f"netem-{region}", "netem", region, args, "netem listening",
                                  module="lab.devstack.netem_process")
        ports = netem.ready_line.rsplit("ports=", 1)[1].split(",")
        for sim, port in zip(sims, ports, strict=True):
            sim.advertise_url = f"http://{region_address(self._region_index(region))}:{port}"
        return netem

    async def _start_worker(self, sim: Child, starts: int = 1) -> Child:
        assert sim.url is not None and sim.region is not None
        spec = self.config.regions[sim.region].simulated
        worker_id = sim.name.removeprefix("sim-")
        args = [
            "worker", "--region", sim.region, "--engine-url", sim.url,
            "--advertise-url", sim.advertise_url or sim.url,
            "--worker-id", worker_id,
            "--redis-url", self.redis_url, "--key-prefix", self.key_prefix,
            "--interval-s", str(self.config.heartbeat.interval_s),
            "--ttl-s", str(self.config.heartbeat.ttl_s),
            "--stuck-after-s", str(self.config.heartbeat.stuck_after_s),
            "--max-num-seqs", str(spec.max_num_seqs),
        ]
        worker = await self._spawn(f"worker-{worker_id}", "worker", sim.region, args, "worker ",
                                   starts=starts, env={**os.environ, **self.signing_env})
        worker.url = sim.url  # the engine it watches
        worker.advertise_url = sim.advertise_url
        return worker

    async def _start_router(self, region: str | None, number: int) -> Child:
        if number == 0:
            host, port = self.host, self.port
        else:
            assert region is not None, "extra router replicas need a region"
            host = region_address(self._region_index(region))
            port = free_port(host)
        args = ["router", "--config", str(self.config_path), "--redis-url", self.redis_url,
                "--host", host, "--port", str(port)]
        if region is not None:
            args += ["--region", region]
        # One process per replica: the lab's replicas share the machine with the
        # simulated regions, and its tests and reports follow each replica's one process.
        env = {**os.environ, **self.signing_env, "GLOBALPOOL_ROUTER_PROCESSES": "1"}
        if self.admin_token is not None:
            env[self.config.admin.token_env] = self.admin_token
        name = "router" if number == 0 else f"router-{region}"
        router = await self._spawn(name, "router", region, args, "router listening", env=env)
        router.url = f"http://{host}:{port}"
        return router

    async def _wait_router_sees(self, url: str, workers: int) -> None:
        deadline = time.monotonic() + self._timeout_s
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError):
                    async with session.get(f"{url}/health",
                                           timeout=aiohttp.ClientTimeout(total=1)) as response:
                        status = await response.json()
                        if status.get("workers", 0) >= workers:
                            return
                await asyncio.sleep(0.1)
        raise StackError(f"the router at {url} did not see all {workers} workers within "
                         f"{self._timeout_s:g} s; see {self.log_dir}")

    def exited(self) -> list[Child]:
        """Children that have exited (for a watcher to report)."""
        return [child for child in self.children if not child.running]

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Routers first, then agents (they drain and remove their heartbeats), sims, Valkey."""
        if self._valkey_frozen:
            self.thaw_redis()
        for role in ("router", "worker", "netem", "sim"):
            await asyncio.gather(*(terminate(c, timeout_s) for c in self.by_role(role)))
        for child in self.children:
            await close(child)
        if self.valkey is not None:
            await asyncio.to_thread(self.valkey.stop)

    # --- faults, for drills -----------------------------------------------------------
    async def kill(self, children: Sequence[Child], sig: int = signal.SIGKILL) -> None:
        """Send `sig` to each child and wait for all of them to exit."""
        for child in children:
            if child.running:
                with contextlib.suppress(ProcessLookupError):
                    child.process.send_signal(sig)
        await asyncio.gather(*(c.process.wait() for c in children))

    async def kill_region(self, region: str) -> list[Child]:
        """SIGKILL every simulator of `region` (its agents live on and report them down)."""
        sims = self.by_role("sim", region)
        await self.kill(sims)
        return sims

    def drain(self, workers: Sequence[Child]) -> None:
        """SIGTERM worker agents: they publish `draining`, wait for in-flight requests,
        remove their heartbeat and exit. Does not wait (see `wait_exited`)."""
        for worker in workers:
            if worker.running:
                worker.process.send_signal(signal.SIGTERM)

    async def wait_exited(self, children: Sequence[Child], timeout_s: float) -> bool:
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.gather(*(c.process.wait() for c in children))
        except TimeoutError:
            return False
        return True

    async def restart(self, child: Child) -> Child:
        """Start an exited sim or worker agent again with the same arguments (same port)."""
        if child.running:
            raise StackError(f"{child.name} is still running (pid {child.pid})")
        await close(child)
        new = await spawn(
            name=child.name, role=child.role, region=child.region, module=child.module,
            args=child.args, ready_prefix=child.ready_prefix, log_path=child.log_path,
            python=self._python, timeout_s=self._timeout_s, env=child.env,
            starts=child.starts + 1,
        )
        new.url = child.url
        new.advertise_url = child.advertise_url
        self.children[self.children.index(child)] = new
        return new

    async def set_sim_faults(self, sim: Child, **knobs: Any) -> dict[str, Any]:
        """POST the simulator's /sim/faults (directly, not through its netem port)."""
        return await self._post(f"{sim.url}/sim/faults", knobs)

    async def set_network(self, region: str, *, extra_rtt_ms: float | None = None,
                          partition: bool | None = None, reset: bool = False,
                          ) -> dict[str, Any]:
        """Change `region`'s emulated network (needs `netem=True`)."""
        netems = self.by_role("netem", region)
        if not netems:
            raise StackError(f"no netem process for region {region!r} (start with netem=True)")
        body: dict[str, Any] = {"reset": reset}
        if extra_rtt_ms is not None:
            body["extra_rtt_ms"] = extra_rtt_ms
        if partition is not None:
            body["partition"] = partition
        return await self._post(f"{netems[0].url}/netem", body)

    async def admin(self, path: str, body: dict[str, Any], *,
                    router: int = 0) -> dict[str, Any]:
        """POST to a router's admin API with the stack's admin token."""
        if self.admin_token is None:
            raise StackError("the stack was started without an admin token")
        url = f"{self.by_role('router')[router].url}{path}"
        headers = {"Authorization": f"Bearer {self.admin_token}"}
        return await self._post(url, body, headers=headers)

    async def _post(self, url: str, body: dict[str, Any],
                    headers: dict[str, str] | None = None) -> dict[str, Any]:
        async with aiohttp.ClientSession(timeout=_HTTP_TIMEOUT) as session, session.post(
            url, json=body, headers=headers
        ) as response:
            text = await response.text()
            if response.status != 200:
                raise StackError(f"POST {url} -> {response.status}: {text[:300]}")
            answer: dict[str, Any] = json.loads(text)
            return answer

    def _own_valkey(self) -> EmbeddedValkey:
        if self.valkey is None:
            raise StackError("Redis is external; the stack cannot stop or start it")
        return self.valkey

    async def stop_redis(self) -> None:
        """Stop the embedded Valkey (its data is lost, as after a crash without persistence)."""
        valkey = self._own_valkey()
        self.thaw_redis()
        await asyncio.to_thread(valkey.stop, 2.0)

    async def start_redis(self) -> None:
        """Start Valkey again on the same port: clients reconnect to the same URL."""
        old = self._own_valkey()
        self.valkey = await asyncio.to_thread(
            EmbeddedValkey.start, host=old.host, port=old.port, die_with_parent=True,
            log_path=self.log_dir / "valkey-restarted.log", password=old.password)

    def freeze_redis(self) -> None:
        """SIGSTOP Valkey: connections are accepted by the kernel but never answered,
        like a partitioned server (calls must time out, not hang)."""
        os.kill(self._own_valkey().pid, signal.SIGSTOP)
        self._valkey_frozen = True

    def thaw_redis(self) -> None:
        if self._valkey_frozen and self.valkey is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.valkey.pid, signal.SIGCONT)
        self._valkey_frozen = False

    # --- describing -------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """What runs where, for `--state-file` and the summary table."""
        return {
            "router_url": self.router_url,
            "router_urls": {region or "-": url for region, url in self.router_urls.items()},
            "redis_url": self.redis_url,
            "redis_pid": self.valkey.pid if self.valkey else None,
            "key_prefix": self.key_prefix,
            "log_dir": str(self.log_dir),
            "children": [
                {"name": c.name, "role": c.role, "region": c.region, "pid": c.pid, "url": c.url,
                 "advertise_url": c.advertise_url}
                for c in self.children
            ],
        }

    def write_state(self, path: Path) -> None:
        """Atomically (write, then rename), so a reader never sees half a file."""
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps(self.describe(), indent=2) + "\n")
        partial.replace(path)


def _check_port_free(host: str, port: int) -> None:
    """Raise OSError if `host:port` cannot be listened on now, as the router will listen
    (SO_REUSEADDR, as aiohttp sets it; port 0 is always free)."""
    if port == 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
