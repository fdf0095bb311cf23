"""Hot reload of regions.yaml: notice a changed file, validate it, swap it in atomically.

The request path reads `ConfigHolder.current` once per request, so a swap never changes
a request that is already in flight; the next request sees the new file. A file that does
not validate is refused: the last good config stays in force and the refusal (file, path
in the document, reason) is kept in `ConfigHolder.last_error` for the log, /admin/status
and the `globalpool_config_reload_errors_total` metric: the first MAX_PROBLEMS problems,
each cut to MAX_PROBLEM_CHARS, and a count of the rest (a file with 5,000 unknown keys
must not make every status poll megabytes long).

The file is read and parsed in a thread (pure-Python YAML parses ~100 KB a second), so
the event loop keeps serving meanwhile, and a file larger than
`config_loader.MAX_CONFIG_BYTES` is refused before it is read.

Some settings are bound when the router starts (its listening address, Redis, the request
body limit, the connect timeout of the upstream connection pool). A reload still takes the
new file, but those keep their start-up values until a restart; `restart_required` names
them.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from router.config import GlobalConfig
from router.config_loader import ConfigError, parse_config_text, read_config_bytes

log = logging.getLogger("globalpool.config")

# Settings read once at start-up: a reload that changes them takes effect on restart.
RESTART_ONLY = (
    "redis.url",
    "redis.key_prefix",
    "batch.storage",
    "router.host",
    "router.port",
    "router.max_body_bytes",
    "router.timeouts.connect_s",
    "router.client_timeouts.header_s",
    "router.health.failures_to_eject",
    "router.health.base_backoff_s",
    "router.health.max_backoff_s",
    "router.health.retry_budget_ratio",
    "router.health.retry_budget_min_per_s",
    "router.queue.enabled",
    "router.queue.max_requests",
    "router.queue.max_wait_ms",
    "auth.rate_limits.redis_timeout_ms",
    "auth.rate_limits.redis_retry_s",
)


@dataclass(frozen=True, slots=True)
class ReloadError:
    """A refused reload: when (Unix seconds) and every problem as `file: path: reason`."""

    at_unix_s: float
    problems: tuple[str, ...]


# What a refusal keeps of its problems (see bounded_problems).
MAX_PROBLEMS = 50
MAX_PROBLEM_CHARS = 300


def bounded_problems(problems: list[str], source: str) -> list[str]:
    """The first MAX_PROBLEMS problems, each cut to MAX_PROBLEM_CHARS, then one line
    `source: ... and N more problems` if there were more."""
    kept = [p if len(p) <= MAX_PROBLEM_CHARS else p[:MAX_PROBLEM_CHARS - 1] + "…"
            for p in problems[:MAX_PROBLEMS]]
    if len(problems) > MAX_PROBLEMS:
        more = len(problems) - MAX_PROBLEMS
        kept.append(f"{source}: ... and {more:,} more problem{'s' if more > 1 else ''} "
                    "(not shown)")
    return kept


def config_version(text: bytes) -> str:
    """A short content hash: equal files have equal versions on every replica."""
    return hashlib.sha256(text).hexdigest()[:12]


MAX_REMEMBERED_RTTS = 4096


class ConfigHolder:
    """The one mutable cell holding the config in force; the watcher is its only writer."""

    __slots__ = ("_listeners", "_refusal_listeners", "_rtt", "_rtt_of", "current", "last_error",
                 "loaded_at_unix_s", "path", "reload_errors", "reloads", "restart_required",
                 "version")

    def __init__(self, config: GlobalConfig, *, path: Path | None = None,
                 version: str | None = None) -> None:
        self.current = config
        self._rtt_of: GlobalConfig | None = None
        self._rtt: dict[tuple[str, str], float] = {}
        self.path = path
        self.version = version or config_version(config.model_dump_json().encode())
        self.loaded_at_unix_s = time.time()
        self.last_error: ReloadError | None = None
        self.reloads = 0
        self.reload_errors = 0
        self.restart_required: tuple[str, ...] = ()
        self._listeners: list[Callable[[GlobalConfig, GlobalConfig], None]] = []
        self._refusal_listeners: list[Callable[[ReloadError], None]] = []

    def rtt_ms(self, src: str, dst: str) -> float:
        """The RTT table of the config in force (a `RttTable` for the routing policy),
        remembered per config: routing asks for every region it scores."""
        config = self.current
        if config is not self._rtt_of:
            self._rtt_of = config
            self._rtt = {}
        key = (src, dst)
        rtt = self._rtt.get(key)
        if rtt is None:
            rtt = config.rtt_ms(src, dst)
            if len(self._rtt) < MAX_REMEMBERED_RTTS:  # region names come from heartbeats
                self._rtt[key] = rtt
        return rtt

    def on_swap(self, listener: Callable[[GlobalConfig, GlobalConfig], None]) -> None:
        """Call `listener(old, new)` after every swap (synchronously, on the event loop)."""
        self._listeners.append(listener)

    def on_refused(self, listener: Callable[[ReloadError], None]) -> None:
        """Call `listener(error)` after every refused reload."""
        self._refusal_listeners.append(listener)

    def swap(self, config: GlobalConfig, version: str, started_with: GlobalConfig) -> None:
        old = self.current
        self.current = config
        self.version = version
        self.loaded_at_unix_s = time.time()
        self.last_error = None
        self.reloads += 1
        self.restart_required = tuple(
            name for name in RESTART_ONLY if _get(config, name) != _get(started_with, name)
        )
        for listener in self._listeners:
            listener(old, config)

    def refuse(self, problems: list[str]) -> None:
        error = self.last_error = ReloadError(time.time(), tuple(problems))
        self.reload_errors += 1
        for listener in self._refusal_listeners:
            listener(error)


def _get(config: GlobalConfig, dotted: str) -> object:
    value: object = config
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def _signature(path: Path) -> tuple[int, int, int] | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return (stat.st_mtime_ns, stat.st_size, stat.st_ino)


class ConfigWatcher:
    """Polls the file's (mtime, size, inode) and reloads it when they change.

    Polling a stat is cheap and works the same for editors that write in place, editors
    that write a new file and rename it, and Kubernetes ConfigMaps (symlink swaps).
    `router_region` is this replica's region: a new file without it is refused, and so is
    one that `extra_checks` (checks beyond the schema, e.g. a known policy name) objects to.
    """

    def __init__(
        self,
        holder: ConfigHolder,
        path: Path,
        *,
        router_region: str | None,
        interval_s: Callable[[], float],
        settle_s: float = 0.05,
        extra_checks: Callable[[GlobalConfig], list[str]] = lambda _config: [],
    ) -> None:
        self._holder = holder
        self._path = path
        self._region = router_region
        self._interval_s = interval_s
        self._settle_s = settle_s
        self._extra_checks = extra_checks
        self._started_with = holder.current
        self._seen = _signature(path)
        self._reloading = asyncio.Lock()  # one reload at a time (poll, API, SIGHUP)

    async def run(self) -> None:
        """Check every `interval_s()` seconds until cancelled; never raises for a bad file."""
        while True:
            interval_s = self._interval_s()
            await asyncio.sleep(interval_s if interval_s > 0 else 5.0)
            if interval_s > 0:
                await self.check()

    async def check(self) -> bool:
        """Reload if the file changed since last seen. Returns True if a new config is in."""
        signature = _signature(self._path)
        if signature == self._seen:
            return False
        # An editor may still be writing: wait until the file holds still for a moment.
        while True:
            await asyncio.sleep(self._settle_s)
            settled = _signature(self._path)
            if settled == signature:
                break
            signature = settled
        self._seen = signature
        return await self.reload()

    async def reload(self) -> bool:
        """Read, validate and swap in the file now. Returns True if it was taken.

        Reading and parsing run in a thread; the swap happens back on the event loop."""
        async with self._reloading:
            try:
                text, config = await asyncio.to_thread(self._read, self._holder.version,
                                                       self._holder.last_error is None)
            except ConfigError as exc:
                return self._refuse(exc.problems)
            if config is None:
                return False  # touched, not changed
            return self._take(config, config_version(text))

    def _read(self, version_in_force: str, in_force_ok: bool) -> tuple[bytes, GlobalConfig | None]:
        """(In a thread.) The file's bytes and its config; None for the config when the
        bytes are those in force and nothing was refused since. Raises ConfigError."""
        source = str(self._path)
        text = read_config_bytes(self._path)
        if config_version(text) == version_in_force and in_force_ok:
            return text, None
        return text, parse_config_text(text, source)

    def _take(self, config: GlobalConfig, version: str) -> bool:
        """Swap in `config` unless a check beyond the schema objects to it."""
        source = str(self._path)
        problems = [f"{source}: {problem}" for problem in self._extra_checks(config)]
        if self._region is not None and self._region not in config.regions:
            problems.append(f"{source}: regions: this router's region {self._region!r} is "
                            "missing (a router cannot leave its region by reload)")
        if problems:
            return self._refuse(problems)
        self._holder.swap(config, version, self._started_with)
        log.info("config reloaded from %s: version %s (%d regions)", source, version,
                 len(config.regions))
        if self._holder.restart_required:
            log.warning("config %s changes %s: takes effect on restart", version,
                        ", ".join(self._holder.restart_required))
        return True

    def _refuse(self, problems: list[str]) -> bool:
        problems = bounded_problems(problems, str(self._path))
        self._holder.refuse(problems)
        log.error("config reload refused; keeping version %s in force:\n  %s",
                  self._holder.version, "\n  ".join(problems))
        return False


def initial_holder(config: GlobalConfig, path: Path | None) -> ConfigHolder:
    """The holder a router starts with; versioned by the file's bytes when there is one."""
    if path is not None:
        try:
            return ConfigHolder(config, path=path, version=config_version(path.read_bytes()))
        except OSError:
            pass
    return ConfigHolder(config, path=path)

