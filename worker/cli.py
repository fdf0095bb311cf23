"""`globalpool worker`: run the agent that sits beside one vLLM (or simulator) server.

Either attach to a running engine (`--engine-url`), or launch and supervise one:

    globalpool worker --region us-east --redis-url redis://... \
        --launch -- vllm serve MODEL --port 8000 --max-num-seqs 64

Everything after `--` is the engine's command line, run as is. Unless given as flags, the
engine URL (`--host`, `--port`; vLLM's defaults are all interfaces and 8000) and
`--max-num-seqs` are read from it.

Settings come from flags, then the environment (REDIS_URL), then `--config regions.yaml`,
then defaults. On start the agent prints one line to stdout,

    worker <id> publishing to <redis> every <interval>s

which launchers wait for; logs (and a launched engine's output) go to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import sys
from collections.abc import Coroutine, Mapping
from pathlib import Path
from typing import Any, Literal, cast
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from worker import redis_client
from worker.agent import AgentSettings, serve
from worker.heartbeat import HeartbeatTiming, WorkerIdentity
from worker.progress import STUCK_AFTER_S
from worker.schema import MAX_SEQS
from worker.signing import KEY_ID_ENV, KEYS_ENV, HeartbeatSigner, SigningKeyError
from worker.supervisor import EngineCommand, RestartPolicy

DEFAULT_INTERVAL_S = 0.5
DEFAULT_TTL_S = 2.0
DEFAULT_KEY_PREFIX = "globalpool"
# vLLM's default --max-num-seqs; /metrics does not expose the configured value.
DEFAULT_MAX_NUM_SEQS = 256
_WORKER_ID_CHARS = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._:@-")


class WorkerConfigError(Exception):
    """Flags, environment and config file do not add up to a runnable worker."""


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """The `worker` subcommand's flags."""
    parser.add_argument("--region", required=True, help="the region this worker serves in")
    parser.add_argument("--engine-url",
                        help="the vLLM server to observe, e.g. http://127.0.0.1:8000 "
                        "(with --launch: default from the command's --host and --port)")
    parser.add_argument("--advertise-url",
                        help="where routers send requests (default: --engine-url)")
    parser.add_argument("--worker-id",
                        help="unique id (default: <region>-<host>-<port> of --advertise-url)")
    parser.add_argument("--redis-url",
                        help="redis://, rediss:// (TLS), redis+sentinel://HOST:PORT[,...]/"
                        "SERVICE or redis+cluster://HOST:PORT[,...] URL (default: "
                        "$REDIS_URL, then --config)")
    parser.add_argument("--key-prefix",
                        help=f"Redis namespace (default: --config, then {DEFAULT_KEY_PREFIX})")
    parser.add_argument("--interval-s", type=float,
                        help=f"seconds between heartbeats, jittered ±20%% "
                        f"(default: --config, then {DEFAULT_INTERVAL_S})")
    parser.add_argument("--ttl-s", type=float,
                        help=f"heartbeat lifetime in Redis (default: --config, then "
                        f"{DEFAULT_TTL_S})")
    parser.add_argument("--stuck-after-s", type=float,
                        help="say `degraded` once the engine has held requests this long "
                        "without running an engine step (a wedged GPU) (default: --config's "
                        f"heartbeat.stuck_after_s, then {STUCK_AFTER_S:g})")
    parser.add_argument("--max-num-seqs", type=int,
                        help="the engine's --max-num-seqs: sequences it runs at once "
                        "(default: the launched command's, then "
                        f"{DEFAULT_MAX_NUM_SEQS}, vLLM's default); per engine, as vLLM "
                        "takes it: a data-parallel server's heartbeat says this times "
                        "the engines its /metrics shows")
    parser.add_argument("--probe-timeout-s", type=float,
                        help="longest wait for each of /health, /metrics, /v1/models; a "
                        "probe that times out counts as failed (default: a third of the TTL, "
                        "at most 1 s; a CPU vLLM under load may need more)")
    parser.add_argument("--drain-timeout-s", type=float, default=30.0,
                        help="on SIGTERM, longest wait for in-flight requests "
                        "(default: %(default)s)")
    parser.add_argument("--engine-kind", choices=("vllm", "sim", "openai"), default="vllm",
                        help="what the engine is, as heartbeats report it (default: vllm)")
    parser.add_argument("--config", type=Path,
                        help="regions.yaml: redis.url, redis.key_prefix, heartbeat.interval_s, "
                        "heartbeat.ttl_s and heartbeat.stuck_after_s when the flags are not "
                        "given")
    launch = parser.add_argument_group(
        "launching the engine", "--launch -- COMMAND...: run the engine as a child process, "
        "restart it when it exits, stop it after the drain")
    launch.add_argument("--launch", action="store_true",
                        help="launch and supervise the engine command given after `--`")
    launch.add_argument("engine_command", nargs="*", metavar="COMMAND",
                        help="with --launch, after `--`: the engine's command line, e.g. "
                        "vllm serve MODEL --port 8000")
    launch.add_argument("--start-timeout-s", type=float, default=600.0,
                        help="longest wait from launch to /health answering before the engine "
                        "is killed and restarted (default: %(default)s)")
    launch.add_argument("--max-restart-backoff-s", type=float, default=30.0,
                        help="the wait before a restart doubles from 1 s up to this "
                        "(default: %(default)s)")
    launch.add_argument("--max-failed-starts", type=int, default=5,
                        help="exit (code 1) after this many launches in a row that never "
                        "became healthy; 0: never (default: %(default)s)")
    launch.add_argument("--stop-timeout-s", type=float, default=30.0,
                        help="after the drain, SIGTERM to the engine's process group, then "
                        "SIGKILL after this many seconds (default: %(default)s)")
    launch.add_argument("--engine-nice", type=int, default=0, metavar="N",
                        help="run the engine at CPU niceness N (0-19), its whole session "
                        "included, so that a CPU-bound engine (vLLM on CPU, or its API "
                        "server under load) cannot starve this agent's probes and "
                        "heartbeats (default: %(default)s)")
    launch.add_argument("--engine-log", type=Path,
                        help="append the engine's output to this file (default: stderr)")
    parser.add_argument("--signing-key-id",
                        help=f"sign heartbeats with this key of ${KEYS_ENV} (or "
                        f"${KEYS_ENV}_FILE); default: ${KEY_ID_ENV}, then the first key. "
                        "Without keys heartbeats are unsigned")


def run_worker(args: argparse.Namespace) -> int:
    """Run the agent until it has drained after SIGTERM/SIGINT; returns the exit code."""
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        settings = settings_from_args(args, os.environ)
    except WorkerConfigError as exc:
        print(f"globalpool worker: {exc}", file=sys.stderr)
        return 2
    try:
        signer = HeartbeatSigner.from_environ(os.environ, args.signing_key_id)
    except SigningKeyError as exc:
        print(f"globalpool worker: {exc}", file=sys.stderr)
        return 2
    if signer is None:
        logging.getLogger("globalpool.worker").warning(
            "heartbeats are unsigned (no %s): routers with signing keys will drop them",
            KEYS_ENV)
    else:
        # The publisher reads the key from the environment (see worker.publisher).
        os.environ[KEY_ID_ENV] = signer.key_id
        logging.getLogger("globalpool.worker").info("signing heartbeats with key %r",
                                                    signer.key_id)

    def announce() -> None:
        print(f"worker {settings.identity.worker_id} publishing to "
              f"{redis_client.redact_url(settings.redis_url)} every "
              f"{settings.timing.interval_s:g}s",
              flush=True)

    return _run(serve(settings, announce=announce))


def _run(main: Coroutine[Any, Any, int]) -> int:
    try:
        import uvloop
    except ImportError:  # Windows: no uvloop
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def settings_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> AgentSettings:
    """Resolve flags > environment > config file > defaults. Raises WorkerConfigError."""
    config = _ConfigView() if args.config is None else _read_config(args.config)
    launch, restart = _launch_settings(args)
    engine_url = _http_url(_engine_url(args, launch), "--engine-url")
    advertise_url = _http_url(args.advertise_url or engine_url, "--advertise-url")
    region: str = args.region
    worker_id: str = args.worker_id or default_worker_id(region, advertise_url)
    if not worker_id or not set(worker_id) <= _WORKER_ID_CHARS:
        raise WorkerConfigError(f"--worker-id {worker_id!r}: use letters, digits and ._:@-")
    redis_url = args.redis_url or environ.get("REDIS_URL") or config.redis.url
    if not redis_url or redis_url == "embedded":
        raise WorkerConfigError("no Redis URL: pass --redis-url or set REDIS_URL")
    problem = redis_client.url_problem(redis_url)
    if problem is not None:
        raise WorkerConfigError(f"Redis URL {redis_client.redact_url(redis_url)}: {problem}")
    interval_s: float = _first(args.interval_s, config.heartbeat.interval_s, DEFAULT_INTERVAL_S)
    ttl_s: float = _first(args.ttl_s, config.heartbeat.ttl_s, DEFAULT_TTL_S)
    if not 0 < interval_s < math.inf:  # (NaN too)
        raise WorkerConfigError(f"--interval-s {interval_s:g}: must be a number > 0")
    if not 2 * interval_s <= ttl_s <= 3600:
        raise WorkerConfigError(
            f"--ttl-s {ttl_s:g}: must be at least twice the interval ({interval_s:g}s) so that "
            "one late heartbeat does not drop the worker, and at most 3600"
        )
    stuck_after_s: float = _first(args.stuck_after_s, config.heartbeat.stuck_after_s,
                                  STUCK_AFTER_S)
    if not 0 < stuck_after_s < math.inf:
        raise WorkerConfigError(f"--stuck-after-s {stuck_after_s:g}: must be a number > 0")
    max_num_seqs = _max_num_seqs(args, launch)
    if not 0 <= args.drain_timeout_s < math.inf:
        raise WorkerConfigError("--drain-timeout-s: must be a number >= 0")
    # Leaves room for the jittered interval and one Redis write inside one TTL.
    probe_timeout_s: float = _first(args.probe_timeout_s, min(1.0, ttl_s / 3))
    if not 0 < probe_timeout_s <= ttl_s / 2:
        raise WorkerConfigError(f"--probe-timeout-s {probe_timeout_s:g}: must be > 0 and at "
                                f"most half the TTL ({ttl_s:g}s)")
    kind = cast(Literal["vllm", "sim", "openai"], args.engine_kind)
    return AgentSettings(
        identity=WorkerIdentity(worker_id, region, advertise_url, max_num_seqs, kind),
        engine_url=engine_url,
        redis_url=redis_url,
        key_prefix=args.key_prefix or config.redis.key_prefix or DEFAULT_KEY_PREFIX,
        # While Redis is down, retry at least once per TTL (at most every 5 s) so that the
        # worker is back in the pool about one TTL after Redis is.
        timing=HeartbeatTiming(interval_s=interval_s, ttl_s=ttl_s,
                               max_backoff_s=max(interval_s, min(ttl_s, 5.0)),
                               stuck_after_s=stuck_after_s),
        drain_timeout_s=args.drain_timeout_s,
        probe_timeout_s=probe_timeout_s,
        launch=launch,
        restart=restart,
    )


def _launch_settings(args: argparse.Namespace) -> tuple[EngineCommand | None, RestartPolicy]:
    command: list[str] = list(args.engine_command or [])
    if not args.launch:
        if command:
            raise WorkerConfigError(
                f"unexpected arguments {' '.join(command)!r}: to launch an engine, "
                "write --launch -- COMMAND..."
            )
        if args.engine_url is None:
            raise WorkerConfigError("pass --engine-url URL, or --launch -- COMMAND...")
        return None, RestartPolicy()
    if not command:
        raise WorkerConfigError("--launch: give the engine's command after `--`, e.g. "
                                "--launch -- vllm serve MODEL --port 8000")
    for flag in ("--start-timeout-s", "--max-restart-backoff-s", "--stop-timeout-s"):
        if not 0 < getattr(args, flag[2:].replace("-", "_")) < math.inf:
            raise WorkerConfigError(f"{flag}: must be a number > 0")
    if args.max_failed_starts < 0:
        raise WorkerConfigError("--max-failed-starts: must be >= 0")
    if not 0 <= args.engine_nice <= 19:
        raise WorkerConfigError("--engine-nice: must be 0..19")
    policy = RestartPolicy(
        start_timeout_s=args.start_timeout_s,
        initial_backoff_s=min(1.0, args.max_restart_backoff_s),
        max_backoff_s=args.max_restart_backoff_s,
        max_failed_starts=args.max_failed_starts,
        stop_timeout_s=args.stop_timeout_s,
    )
    return EngineCommand(tuple(command), log_path=args.engine_log,
                         niceness=args.engine_nice), policy


def _engine_url(args: argparse.Namespace, launch: EngineCommand | None) -> str:
    """--engine-url, else where the launched vLLM listens (its --host and --port)."""
    if args.engine_url is not None or launch is None:
        return str(args.engine_url)
    host = option_value(launch.argv, "--host") or "127.0.0.1"
    if host in ("0.0.0.0", "", "::"):
        host = "127.0.0.1" if host != "::" else "::1"
    if ":" in host:
        host = f"[{host}]"
    port = option_value(launch.argv, "--port") or "8000"
    if not port.isdigit():
        raise WorkerConfigError(f"the launched command's --port {port!r}: expected a number")
    return f"http://{host}:{port}"


def _max_num_seqs(args: argparse.Namespace, launch: EngineCommand | None) -> int:
    value: int | None = args.max_num_seqs
    source = "--max-num-seqs"
    if value is None and launch is not None:
        text = option_value(launch.argv, "--max-num-seqs")
        if text is not None:
            source = "the launched command's --max-num-seqs"
            try:
                value = int(text)
            except ValueError:
                raise WorkerConfigError(f"{source} {text!r}: expected a number") from None
    if value is None:
        return DEFAULT_MAX_NUM_SEQS
    if not 1 <= value <= MAX_SEQS:
        raise WorkerConfigError(f"{source}: must be 1..{MAX_SEQS:,} (a heartbeat carries no "
                                "more)")
    return value


def option_value(argv: tuple[str, ...], option: str) -> str | None:
    """The last value of `option` in a command line (`--opt V` or `--opt=V`; vLLM accepts
    underscores for dashes too), or None."""
    spellings = {option, "--" + option[2:].replace("-", "_")}
    found: str | None = None
    for index, arg in enumerate(argv):
        name, equals, value = arg.partition("=")
        if name in spellings:
            if equals:
                found = value
            elif index + 1 < len(argv):
                found = argv[index + 1]
    return found


def default_worker_id(region: str, advertise_url: str) -> str:
    """`<region>-<host>-<port>` of the URL routers use, which is unique across machines."""
    parts = urlsplit(advertise_url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{region}-{parts.hostname}-{port}"


def _http_url(url: str, flag: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise WorkerConfigError(f"{flag} {url!r}: expected http://host:port or https://...")
    try:
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError:
        raise WorkerConfigError(f"{flag} {url!r}: invalid port") from None
    return url.rstrip("/")


def _first(*values: float | None) -> float:
    return next(v for v in values if v is not None)


# The sections of regions.yaml a worker reads. The router's loader validates the whole
# file; `worker` must not import `router`, so this view reads only what it needs.
class _Section(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class _RedisSection(_Section):
    url: str | None = None
    key_prefix: str | None = Field(default=None, pattern=r"^[A-Za-z0-9:_.-]+$")


class _HeartbeatSection(_Section):
    interval_s: float | None = Field(default=None, gt=0, le=60)
    ttl_s: float | None = Field(default=None, gt=0, le=600)
    stuck_after_s: float | None = Field(default=None, gt=0, le=86_400)


class _ConfigView(_Section):
    redis: _RedisSection = _RedisSection()
    heartbeat: _HeartbeatSection = _HeartbeatSection()


def _read_config(path: Path) -> _ConfigView:
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise WorkerConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise WorkerConfigError(f"{path}: invalid YAML: {exc}") from None
    try:
        return _ConfigView.model_validate(document if document is not None else {})
    except ValidationError as exc:
        problems = [
            f"{path}: {'.'.join(str(part) for part in error['loc']) or '(document)'}: "
            f"{error['msg']}"
            for error in exc.errors()
        ]
        raise WorkerConfigError("; ".join(problems)) from None


def main(argv: list[str] | None = None) -> int:
    """`python -m worker.cli ...`, for running a worker without the `globalpool` command."""
    parser = argparse.ArgumentParser(
        prog="globalpool worker", description="heartbeat one engine's state to Redis"
    )
    add_worker_arguments(parser)
    return run_worker(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
