"""The whole system on one machine: Valkey, simulated regional pools, worker agents, a router.

Each simulated region gets its own loopback address (127.0.X.1); every child is a real
process with a known PID whose logs go to `log_dir`. `LocalStack` is used by
`globalpool up` and by the integration tests alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import aiohttp

from router.config import GlobalConfig
from router.devstack.process import die_with_parent
from router.devstack.valkey import EmbeddedValkey

Progress = Callable[[str], None]


class StackError(RuntimeError):
    """A part of the local stack did not start; the message says which and where its log is."""


@dataclass
class Child:
    """One running process of the stack."""

    name: str
    role: str  # "sim" | "worker" | "router"
    region: str | None
    process: asyncio.subprocess.Process
    log_path: Path
    url: str | None = None
    _log: IO[bytes] | None = field(default=None, repr=False)
    _drain: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def running(self) -> bool:
        return self.process.returncode is None


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
    ) -> None:
        self.config = config
        self.config_path = config_path
        self.host = host
        self.port = port
        self.log_dir = log_dir
        self.key_prefix = key_prefix or config.redis.key_prefix
        self._redis_url = redis_url
        self._progress = progress
        self._timeout_s = start_timeout_s
        self._python = python
        self.valkey: EmbeddedValkey | None = None
        self.children: list[Child] = []
        self._steps_done = 0
        self._steps_total = 2 + 2 * sum(r.simulated.workers for r in config.regions.values())

    @property
    def redis_url(self) -> str:
        if self._redis_url is not None:
            return self._redis_url
        assert self.valkey is not None, "stack not started"
        return self.valkey.url

    @property
    def router_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _step(self, line: str) -> None:
        self._steps_done += 1
        width = len(str(self._steps_total))
        self._progress(f"[{self._steps_done:>{width}}/{self._steps_total}] {line}")

    async def start(self) -> None:
        """Bring every part up in dependency order; on any failure stop what started."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> None:
        if self._redis_url is None:
            self.valkey = EmbeddedValkey.start(
                die_with_parent=True, log_path=self.log_dir / "valkey.log"
            )
            self._step(f"valkey      {self.valkey.url} (pid {self.valkey.pid})")
        else:
            self._step(f"redis       {self.redis_url} (external)")
        sims = [
            self._start_sim(region, index, number)
            for index, (region, spec) in enumerate(self.config.regions.items())
            for number in range(1, spec.simulated.workers + 1)
        ]
        for sim in await asyncio.gather(*sims):
            self._step(f"sim         {sim.name:<14} {sim.url} (pid {sim.pid})")
        sim_children = [c for c in self.children if c.role == "sim"]
        workers = await asyncio.gather(*(self._start_worker(sim) for sim in sim_children))
        for worker in workers:
            self._step(f"worker      {worker.name:<14} -> {self.redis_url} (pid {worker.pid})")
        router = await self._start_router()
        await self._wait_router_sees(len(sim_children))
        self._step(f"router      {self.config.router.region or '-':<14} {router.url} "
                   f"(pid {router.pid})")

    async def _spawn(
        self, name: str, role: str, region: str | None, args: Sequence[str], ready_prefix: str
    ) -> Child:
        log_path = self.log_dir / f"{name}.log"
        log = log_path.open("wb")
        process = await asyncio.create_subprocess_exec(
            self._python, "-m", "router.cli", *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=log,
            preexec_fn=die_with_parent,
        )
        child = Child(name=name, role=role, region=region, process=process, log_path=log_path,
                      _log=log)
        self.children.append(child)
        line = await self._read_ready_line(child, ready_prefix)
        child.url = line.split()[-1] if line.split() else None
        child._drain = asyncio.create_task(self._drain_stdout(child))
        return child

    async def _read_ready_line(self, child: Child, prefix: str) -> str:
        assert child.process.stdout is not None
        deadline = time.monotonic() + self._timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StackError(f"{child.name} did not start in {self._timeout_s:g} s; "
                                 f"see {child.log_path}")
            try:
                raw = await asyncio.wait_for(child.process.stdout.readline(), remaining)
            except TimeoutError:
                continue
            if not raw:
                await child.process.wait()
                raise StackError(f"{child.name} exited with {child.process.returncode} while "
                                 f"starting; see {child.log_path}:\n{_tail(child.log_path)}")
            text = raw.decode(errors="replace").strip()
            if text.startswith(prefix):
                return text

    async def _drain_stdout(self, child: Child) -> None:
        assert child.process.stdout is not None and child._log is not None
        while line := await child.process.stdout.readline():
            child._log.write(line)
            child._log.flush()

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
            "--seed", str(index * 100 + number),
        ]
        return await self._spawn(f"sim-{region}-{number}", "sim", region, args, "sim listening")

    async def _start_worker(self, sim: Child) -> Child:
        assert sim.url is not None and sim.region is not None
        spec = self.config.regions[sim.region].simulated
        worker_id = sim.name.removeprefix("sim-")
        args = [
            "worker", "--region", sim.region, "--engine-url", sim.url,
            "--worker-id", worker_id,
            "--redis-url", self.redis_url, "--key-prefix", self.key_prefix,
            "--interval-s", str(self.config.heartbeat.interval_s),
            "--ttl-s", str(self.config.heartbeat.ttl_s),
            "--max-num-seqs", str(spec.max_num_seqs),
        ]
        worker = await self._spawn(f"worker-{worker_id}", "worker", sim.region, args, "worker ")
        worker.url = sim.url  # the engine it watches and advertises
        return worker

    async def _start_router(self) -> Child:
        args = [
            "router", "--config", str(self.config_path), "--redis-url", self.redis_url,
            "--host", self.host, "--port", str(self.port),
        ]
        router = await self._spawn("router", "router", self.config.router.region, args,
                                   "router listening")
        router.url = self.router_url
        return router

    async def _wait_router_sees(self, workers: int) -> None:
        deadline = time.monotonic() + self._timeout_s
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                    async with session.get(f"{self.router_url}/health",
                                           timeout=aiohttp.ClientTimeout(total=1)) as response:
                        status = await response.json()
                        if status.get("workers", 0) >= workers:
                            return
                await asyncio.sleep(0.1)
        raise StackError(f"the router did not see all {workers} workers within "
                         f"{self._timeout_s:g} s; see {self.log_dir}")

    def exited(self) -> list[Child]:
        """Children that have exited (for a watcher to report)."""
        return [child for child in self.children if not child.running]

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Router first, then agents (they drain and remove their heartbeats), sims, Valkey."""
        for role in ("router", "worker", "sim"):
            group = [c for c in self.children if c.role == role]
            await asyncio.gather(*(_terminate(c, timeout_s) for c in group))
        for child in self.children:
            if child._drain is not None:
                child._drain.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await child._drain
            if child._log is not None:
                child._log.close()
        if self.valkey is not None:
            self.valkey.stop()

    def describe(self) -> dict[str, Any]:
        """What runs where, for `--state-file` and the summary table."""
        return {
            "router_url": self.router_url,
            "redis_url": self.redis_url,
            "redis_pid": self.valkey.pid if self.valkey else None,
            "key_prefix": self.key_prefix,
            "log_dir": str(self.log_dir),
            "children": [
                {"name": c.name, "role": c.role, "region": c.region, "pid": c.pid, "url": c.url}
                for c in self.children
            ],
        }

    def write_state(self, path: Path) -> None:
        """Atomically (write, then rename), so a reader never sees half a file."""
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps(self.describe(), indent=2) + "\n")
        partial.replace(path)


async def _terminate(child: Child, timeout_s: float) -> None:
    if child.process.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        child.process.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(child.process.wait(), timeout_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            child.process.kill()
        await child.process.wait()


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
