"""`globalpool worker`: run the agent that sits beside one vLLM (or simulator) server.

Settings come from flags, then the environment (REDIS_URL), then `--config regions.yaml`,
then defaults. On start the agent prints one line to stdout,

    worker <id> publishing to <redis> every <interval>s

which launchers wait for; logs go to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Coroutine, Mapping
from pathlib import Path
from typing import Any, Literal, cast
from urllib.parse import urlsplit, urlunsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from worker.agent import AgentSettings, serve
from worker.heartbeat import HeartbeatTiming, WorkerIdentity

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
    parser.add_argument("--engine-url", required=True,
                        help="the vLLM server to observe, e.g. http://127.0.0.1:8000")
    parser.add_argument("--advertise-url",
                        help="where routers send requests (default: --engine-url)")
    parser.add_argument("--worker-id",
                        help="unique id (default: <region>-<host>-<port> of --advertise-url)")
    parser.add_argument("--redis-url",
                        help="redis:// or rediss:// URL (default: $REDIS_URL, then --config)")
    parser.add_argument("--key-prefix",
                        help=f"Redis namespace (default: --config, then {DEFAULT_KEY_PREFIX})")
    parser.add_argument("--interval-s", type=float,
                        help=f"seconds between heartbeats, jittered ±20%% "
                        f"(default: --config, then {DEFAULT_INTERVAL_S})")
    parser.add_argument("--ttl-s", type=float,
                        help=f"heartbeat lifetime in Redis (default: --config, then "
                        f"{DEFAULT_TTL_S})")
    parser.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS,
                        help="the engine's --max-num-seqs: sequences it runs at once "
                        "(default: %(default)s, vLLM's default)")
    parser.add_argument("--drain-timeout-s", type=float, default=30.0,
                        help="on SIGTERM, longest wait for in-flight requests "
                        "(default: %(default)s)")
    parser.add_argument("--engine-kind", choices=("vllm", "sim", "openai"), default="vllm",
                        help="what the engine is, as heartbeats report it (default: vllm)")
    parser.add_argument("--config", type=Path,
                        help="regions.yaml: redis.url, redis.key_prefix, heartbeat.interval_s "
                        "and heartbeat.ttl_s when the flags are not given")


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

    def announce() -> None:
        print(f"worker {settings.identity.worker_id} publishing to "
              f"{redact_url(settings.redis_url)} every {settings.timing.interval_s:g}s",
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
    engine_url = _http_url(args.engine_url, "--engine-url")
    advertise_url = _http_url(args.advertise_url or engine_url, "--advertise-url")
    region: str = args.region
    worker_id: str = args.worker_id or default_worker_id(region, advertise_url)
    if not worker_id or not set(worker_id) <= _WORKER_ID_CHARS:
        raise WorkerConfigError(f"--worker-id {worker_id!r}: use letters, digits and ._:@-")
    redis_url = args.redis_url or environ.get("REDIS_URL") or config.redis.url
    if not redis_url or redis_url == "embedded":
        raise WorkerConfigError("no Redis URL: pass --redis-url or set REDIS_URL")
    interval_s: float = _first(args.interval_s, config.heartbeat.interval_s, DEFAULT_INTERVAL_S)
    ttl_s: float = _first(args.ttl_s, config.heartbeat.ttl_s, DEFAULT_TTL_S)
    if interval_s <= 0:
        raise WorkerConfigError(f"--interval-s {interval_s:g}: must be > 0")
    if not 2 * interval_s <= ttl_s <= 3600:
        raise WorkerConfigError(
            f"--ttl-s {ttl_s:g}: must be at least twice the interval ({interval_s:g}s) so that "
            "one late heartbeat does not drop the worker, and at most 3600"
        )
    if args.max_num_seqs < 1:
        raise WorkerConfigError("--max-num-seqs: must be >= 1")
    if args.drain_timeout_s < 0:
        raise WorkerConfigError("--drain-timeout-s: must be >= 0")
    kind = cast(Literal["vllm", "sim", "openai"], args.engine_kind)
    return AgentSettings(
        identity=WorkerIdentity(worker_id, region, advertise_url, args.max_num_seqs, kind),
        engine_url=engine_url,
        redis_url=redis_url,
        key_prefix=args.key_prefix or config.redis.key_prefix or DEFAULT_KEY_PREFIX,
        # While Redis is down, retry at least once per TTL (at most every 5 s) so that the
        # worker is back in the pool about one TTL after Redis is.
        timing=HeartbeatTiming(interval_s=interval_s, ttl_s=ttl_s,
                               max_backoff_s=max(interval_s, min(ttl_s, 5.0))),
        drain_timeout_s=args.drain_timeout_s,
        # Leaves room for the jittered interval and one Redis write inside one TTL.
        probe_timeout_s=min(1.0, ttl_s / 3),
    )


def default_worker_id(region: str, advertise_url: str) -> str:
    """`<region>-<host>-<port>` of the URL routers use, which is unique across machines."""
    parts = urlsplit(advertise_url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{region}-{parts.hostname}-{port}"


def redact_url(url: str) -> str:
    """The URL without its password, fit for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = f"{parts.username}:***@" if parts.username else ":***@"
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=user + host))


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
