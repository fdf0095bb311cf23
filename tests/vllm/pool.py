"""Two real vLLM servers as two regions, each launched by `globalpool worker --launch`,
with a real Valkey and a real router in front: what a user runs, on loopback.

Region i's vLLM listens on 127.0.i.1 and is pinned to core i-1 (the machine has two);
caches and TMPDIR live under the test's work folder. The settings below were measured on
this machine kind (see issue 3): a 64 MiB KV cache, ~1.4-1.7 GiB and ~20-60 s to healthy
per server. A test may start more servers (`start_agent` with a name of its own, e.g. a
pooling-runner one for embeddings), each on its own loopback address.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import redis
import yaml

from lab.devstack.valkey import free_port
from tests.procfs import children
from worker.heartbeat_keys import HeartbeatKeys
from worker.schema import Heartbeat, LifecycleState
from worker.signing import KEYS_ENV
from worker.supervisor import die_with_parent

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-llama"
# The same model under the pooling runner (EMBED_ARGS), when a test starts such a server.
EMBED_MODEL = "tiny-embed"
MAX_NUM_SEQS = 16
# Long enough that 16 requests of ~2000 tokens keep a CPU vLLM's queue full for seconds
# (the model has 2048 positions; 2048 tokens of KV cache are 2 MiB of the 64).
MAX_MODEL_LEN = 2048
# vLLM's --max-num-queued-reqs caps running + waiting requests (check_admission): past it,
# 503 "The engine is currently busy".
MAX_UNFINISHED = MAX_NUM_SEQS + 8
REGIONS = ("us-east", "eu-west")
HEARTBEAT_INTERVAL_S = 0.2
# A CPU vLLM busy with a burst answers /metrics late (its API server shares two cores
# with everything else): probes may take up to PROBE_TIMEOUT_S, the TTL leaves room.
# The TTL also has to outlast this machine's stalls of single processes (an agent not
# scheduled for several seconds while a router is): 15 s.
HEARTBEAT_TTL_S = 15.0
PROBE_TIMEOUT_S = 2.5
# An engine that holds requests and runs no step this long is stuck (agent's
# --stuck-after-s; 15 s by default). Shorter than the default, so that the tier's wedged
# engine is found in seconds; longer than any step of these CPU engines, and than the
# 6 s pause of test_a_paused_engine_keeps_requests_that_have_nowhere_else_to_go.
STUCK_AFTER_S = 8.0
START_TIMEOUT_S = 300.0
# The agents launch vLLM with --engine-nice: on this machine the engines' compute threads
# and the control plane (agents, routers, Valkey, the test) share two cores, and each
# engine runs in its own session, which the kernel's autogroup scheduling weighs like the
# test's whole process tree: a busy engine would starve its agent's probes and heartbeats
# for seconds (heartbeats go stale, which is not what these tests are about).
ENGINE_NICENESS = 10
# What the generate-runner servers need beyond the defaults. vLLM 0.32 answers
# tool_choice "required" or a named function with a 400 ("... requires --tool-call-parser
# to be set") unless a tool parser is configured, and it configures one only together with
# --enable-auto-tool-choice. Any parser that keeps `supports_required_and_named` works:
# vLLM then constrains the output to the tools' JSON schema itself; "pythonic" needs no
# special tokens in the tokenizer. Without disable_any_whitespace, the random-weight model
# fills the allowed JSON whitespace for hundreds of tokens (measured: "required" calls cut
# at 200 tokens, still open).
GENERATE_ARGS = (
    "--enable-auto-tool-choice", "--tool-call-parser", "pythonic",
    "--structured-outputs-config",
    json.dumps({"backend": "xgrammar", "disable_any_whitespace": True}),
)
# The same tiny model under the pooling runner: /v1/embeddings instead of generation.
EMBED_ARGS = ("--convert", "embed")


def vllm_command(python: Path, model_dir: Path, host: str, port: int, *,
                 served_name: str = MODEL, engine_args: tuple[str, ...] = GENERATE_ARGS,
                 ) -> list[str]:
    """The engine command after `globalpool worker --launch --`."""
    return [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", served_name,
        "--host", host, "--port", str(port),
        "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
        "--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-queued-reqs", str(MAX_UNFINISHED),
        "--enable-prefix-caching", "--enforce-eager",
        "--kv-cache-memory-bytes", str(64 * 1024 * 1024),
        *engine_args,
    ]


def vllm_environment(work: Path, index: int) -> dict[str, str]:
    """What each server needs on a CPU machine without network (issue 3, measured).
    Server `index` is pinned to core index mod the machine's cores; it stores the
    Responses API's answers (vLLM keeps none without VLLM_ENABLE_RESPONSES_API_STORE)."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    cache = work / f"cache-{index}"
    tmp = work / f"tmp-{index}"
    tmp.mkdir(parents=True, exist_ok=True)
    env.update({
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(work / "hf-home"),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_HOST_IP": "127.0.0.1",  # else the engine binds a non-loopback address
        "VLLM_CACHE_ROOT": str(cache / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
        "TMPDIR": str(tmp),
        "VLLM_CPU_OMP_THREADS_BIND": str(index % (os.cpu_count() or 1)),  # one core each
        "VLLM_ENABLE_RESPONSES_API_STORE": "1",
        "PYTHONPATH": str(ROOT),
    })
    return env


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, depth first."""
    return [pid_below for child in children(pid) for pid_below in (child, *descendants(child))]


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def pss_mib(pids: list[int]) -> float:
    """Proportional set size of these processes together (shared pages counted once)."""
    total_kib = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total_kib += int(line.split()[1])
    return total_kib / 1024


@dataclass
class Agent:
    """One `globalpool worker --launch` process and the vLLM it runs."""

    region: str
    host: str
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path
    engine_log_path: Path
    started_at: float
    seen_pids: set[int] = field(default_factory=set)

    @property
    def worker_id(self) -> str:
        return f"{self.region}-{self.host}-{self.port}"

    @property
    def engine_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def engine_pid(self) -> int | None:
        """The vLLM API server: the agent's one child."""
        found = children(self.process.pid)
        return found[0] if found else None

    def engine_tree(self) -> list[int]:
        """The vLLM processes (API server, engine core, workers); remembered for the
        check that none outlives the agent."""
        pids = descendants(self.process.pid)
        self.seen_pids.update(pids)
        return pids

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


class RealPool:
    """Start with `start()`, stop with `stop()`; `measurements` collects what was timed."""

    def __init__(self, work: Path, vllm_python: Path, model_dir: Path, redis_url: str,
                 key_prefix: str) -> None:
        self.work = work
        self.vllm_python = vllm_python
        self.model_dir = model_dir
        self.redis_url = redis_url
        self.keys = HeartbeatKeys(key_prefix)
        self.key_prefix = key_prefix
        self.agents: dict[str, Agent] = {}
        self.routers: list[subprocess.Popen[bytes]] = []
        self.router_url = ""
        self.config_path = work / "regions.yaml"
        self.measurements: dict[str, Any] = {}
        # Signed heartbeats, as a deployment has them: one key for the agents and routers.
        self.signing_env = {KEYS_ENV: f"vllm-tier:{secrets.token_urlsafe(32)}"}
        # The test's own reads of heartbeats: a stall of this host (measured up to 13 s in
        # one run of the tier) must not time them out (redis-py's default is 5 s).
        self._redis = redis.Redis.from_url(redis_url, socket_timeout=60,
                                           socket_connect_timeout=60)

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        self._write_config()
        for index, region in enumerate(REGIONS):
            self.start_agent(region, index)
        for region in REGIONS:
            self.wait_for_state(region, LifecycleState.READY, timeout_s=START_TIMEOUT_S)
            agent = self.agents[region]
            self.measurements[f"time to ready, {region} (s)"] = round(
                time.monotonic() - agent.started_at, 1)
            self.measurements[f"vLLM memory at start, {region} (PSS MiB)"] = round(
                pss_mib(agent.engine_tree()))
        self.router_url, router = self.start_router()
        self.routers.append(router)
        self.wait_router_sees(self.router_url, len(REGIONS))

    def start_agent(self, region: str, index: int, *, name: str | None = None,
                    served_name: str = MODEL, engine_args: tuple[str, ...] = GENERATE_ARGS,
                    engine_env: dict[str, str] | None = None) -> Agent:
        """Launch server `index` (on 127.0.<index+1>.1) in `region`, known in `agents` by
        `name` (default: the region), with `engine_env` added to its environment; does not
        wait for it to be ready."""
        name = name or region
        host = f"127.0.{index + 1}.1"
        port = free_port(host)
        log_path = self.work / f"agent-{name}.log"
        engine_log = self.work / f"vllm-{name}.log"
        argv = [
            sys.executable, "-m", "worker.cli", "--region", region,
            "--redis-url", self.redis_url, "--key-prefix", self.key_prefix,
            "--interval-s", str(HEARTBEAT_INTERVAL_S), "--ttl-s", str(HEARTBEAT_TTL_S),
            "--probe-timeout-s", str(PROBE_TIMEOUT_S), "--stuck-after-s", str(STUCK_AFTER_S),
            "--drain-timeout-s", "60", "--start-timeout-s", str(START_TIMEOUT_S),
            "--max-restart-backoff-s", "2", "--stop-timeout-s", "20",
            "--engine-log", str(engine_log),
            "--engine-nice", str(ENGINE_NICENESS),
            "--launch", "--", *vllm_command(self.vllm_python, self.model_dir, host, port,
                                            served_name=served_name, engine_args=engine_args),
        ]
        with log_path.open("ab") as log:
            # die_with_parent: a test run that is killed still drains and stops the agents.
            process = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log,
                                       stderr=subprocess.STDOUT, preexec_fn=die_with_parent,
                                       env={**vllm_environment(self.work, index),
                                            **self.signing_env, **(engine_env or {})})
        agent = Agent(region, host, port, process, log_path, engine_log, time.monotonic())
        self.agents[name] = agent
        return agent

    def stop_agent(self, name: str) -> list[int]:
        """Stop one agent (it drains and stops its vLLM); the PIDs of its that are left.
        It stays in `agents`, so that `stop()` checks its processes again."""
        agent = self.agents[name]
        agent.engine_tree()
        _terminate(agent.process, 120)
        return sorted(pid for pid in {agent.process.pid, *agent.seen_pids} if alive(pid))

    def start_router(self, *extra: str, queue: bool = True,
                     settings: dict[str, Any] | None = None,
                     regions: dict[str, Any] | None = None,
                     ) -> tuple[str, subprocess.Popen[bytes]]:
        """A router replica; `queue=False`: without its queue for busy workers (every
        request is sent at once, as before router.admission.queue existed); `settings`:
        more of regions.yaml's `router` section; `regions`: more regions."""
        port = free_port()
        log_path = self.work / f"router-{port}.log"
        config_path = self.config_path
        if not queue or settings or regions:
            config_path = self.work / f"regions-{port}.yaml"
            self._write_config(config_path, regions or {}, **(settings or {}),
                               **({} if queue else {"queue": {"enabled": False}}))
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "router.cli", "router", "--config",
                 str(config_path), "--redis-url", self.redis_url, "--host", "127.0.0.1",
                 "--port", str(port), "--seed", "7", *extra],
                cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONPATH": str(ROOT), **self.signing_env,
                     "GLOBALPOOL_ROUTER_PROCESSES": "1"},
                preexec_fn=die_with_parent,
            )
        url = f"http://127.0.0.1:{port}"
        self.wait_router_sees(url, 1, process=process)
        return url, process

    def stop(self) -> list[int]:
        """Routers, then agents (they drain and stop their vLLM). Returns leftover PIDs."""
        for router in self.routers:
            _terminate(router, 10)
        for name in self.agents:
            self.stop_agent(name)
        self._redis.close()
        seen = {pid for agent in self.agents.values() for pid in agent.seen_pids}
        seen |= {agent.process.pid for agent in self.agents.values()}
        return sorted(pid for pid in seen if alive(pid))

    def _write_config(self, path: Path | None = None, regions: dict[str, Any] | None = None,
                      **router: Any) -> None:
        document = {
            "apiVersion": "globalpool/v1",
            "redis": {"url": self.redis_url, "key_prefix": self.key_prefix},
            "router": {"region": "us-east", "host": "127.0.0.1", "port": 0,
                       "max_attempts": 3,
                       # connect_s: on loopback a connect is accepted or refused at
                       # once, unless this machine stalls the router (measured up to
                       # 48 s while the engines run); uvloop then fires the expired
                       # timer before it sees the completed connect.
                       "timeouts": {"connect_s": 60, "first_byte_s": 90, "idle_s": 60,
                                    "total_s": 240}, **router},
            "heartbeat": {"interval_s": HEARTBEAT_INTERVAL_S, "ttl_s": HEARTBEAT_TTL_S},
            "regions": {
                # A region's models are an allow-list: the router drops the heartbeats
                # of a worker serving another (model_not_listed).
                "us-east": {"rtt_ms": {"us-east": 1, "eu-west": 80},
                            "models": [MODEL, EMBED_MODEL]},
                "eu-west": {"rtt_ms": {"eu-west": 1}, "models": [MODEL]},
                **(regions or {}),
            },
        }
        (path or self.config_path).write_text(yaml.safe_dump(document))

    # -- observing -----------------------------------------------------------------------

    def heartbeat(self, name: str) -> Heartbeat | None:
        """The stored heartbeat of agent `name` (a region, unless started with a name)."""
        raw = self._redis.get(self.keys.worker(self.agents[name].worker_id))
        return None if raw is None else Heartbeat.from_json(raw)

    def wait_for_state(self, name: str, state: LifecycleState, timeout_s: float = 30.0,
                       ) -> Heartbeat:
        agent = self.agents[name]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            beat = self.heartbeat(name)
            if beat is not None and beat.state is state:
                return beat
            if agent.process.poll() is not None:
                raise AssertionError(f"agent {name} exited with {agent.process.returncode}:\n"
                                     f"{_tail(agent.log_path)}\n{_tail(agent.engine_log_path)}")
            time.sleep(0.05)
        raise AssertionError(f"{name} not {state.value} within {timeout_s:g} s:\n"
                             f"{_tail(agent.log_path)}\n{_tail(agent.engine_log_path)}")

    def wait_router_sees(self, url: str, workers: int, *,
                         process: subprocess.Popen[bytes] | None = None,
                         timeout_s: float = 30.0) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError), \
                    urllib.request.urlopen(f"{url}/health", timeout=1) as response:
                if json.loads(response.read()).get("workers", 0) >= workers:
                    return
            if process is not None and process.poll() is not None:
                raise AssertionError(f"router exited with {process.returncode}")
            time.sleep(0.1)
        raise AssertionError(f"router {url} did not see {workers} workers in {timeout_s} s")

    def client(self, region: str | None = None, url: str | None = None,
               timeout_s: float = 120.0) -> openai.OpenAI:
        """The unchanged `openai` client, as if from `region` (router) — no retries of its
        own, so that every retry seen is the router's."""
        headers = {"x-globalpool-client-region": region} if region else None
        return openai.OpenAI(base_url=f"{url or self.router_url}/v1", api_key="unused",
                             default_headers=headers, max_retries=0, timeout=timeout_s)

    def async_client(self, region: str | None = None, url: str | None = None,
                     timeout_s: float = 120.0) -> openai.AsyncOpenAI:
        # A connection per request: this machine's host can stall it for tens of seconds
        # (measured up to 48 s while two CPU engines run), and a keep-alive connection
        # that the server's idle timer closes the moment the machine resumes would fail
        # the next request with a read error (a client's keep-alive race, not the
        # router's; max_retries=0 keeps every router failure visible).
        headers = {"Connection": "close"}
        if region:
            headers["x-globalpool-client-region"] = region
        return openai.AsyncOpenAI(base_url=f"{url or self.router_url}/v1", api_key="unused",
                                  default_headers=headers, max_retries=0, timeout=timeout_s)


def _terminate(process: subprocess.Popen[bytes], timeout_s: float) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"({path} unreadable)"
