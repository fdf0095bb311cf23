"""The heartbeat loop: probe the engine, build a Heartbeat, publish it; again, forever.

Every interval (jittered ±20% so that a fleet restarted together does not beat in step)
the loop probes the engine and publishes what it saw, whatever it saw: routers must learn
that a worker went `degraded` just as much as that it is `ready` (worker.lifecycle decides
which). A heartbeat's `sent_at_s` never goes back within one agent, even when the wall
clock does (HeartbeatLoop.sent_at_s). Redis outages are logged once, retried with bounded
backoff and never end the loop. The clock, the sleep and the randomness are injected so
that the timing is testable.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar

from worker.engine_performance import PerformanceTracker
from worker.lifecycle import EngineView as EngineView
from worker.lifecycle import Lifecycle
from worker.lifecycle import next_state as next_state
from worker.probe import ProbeResult, ServedModels
from worker.progress import STUCK_AFTER_S, ProgressWatch
from worker.publisher import RedisUnavailableError
from worker.schema import (
    MAX_SEQS,
    Capacity,
    EngineInfo,
    Heartbeat,
    LifecycleState,
    Load,
    Performance,
)

log = logging.getLogger(__name__)

JITTER_FRACTION = 0.2
# The least a heartbeat's `sent_at_s` exceeds the previous one's by (HeartbeatLoop.sent_at_s).
SENT_AT_STEP_S = 1e-3

_T = TypeVar("_T")


class Prober(Protocol):
    async def probe(self) -> ProbeResult: ...


class Publisher(Protocol):
    async def publish(self, heartbeat: Heartbeat) -> None: ...


class EngineProcess(Protocol):
    """A supervised engine process (worker.supervisor.EngineSupervisor), when there is one."""

    @property
    def down(self) -> bool:
        """The process is not running: it exited or missed its start deadline."""
        ...


@dataclass(frozen=True)
class WorkerIdentity:
    """What a heartbeat says about the worker itself; fixed for the life of the process."""

    worker_id: str
    region: str
    endpoint: str
    max_num_seqs: int
    engine_kind: Literal["vllm", "sim", "openai"] = "vllm"


@dataclass(frozen=True)
class HeartbeatTiming:
    """`interval_s` between heartbeats; `ttl_s` of each; `max_backoff_s` while Redis is down;
    `failed_probes_to_degrade`: probes among the last `probe_window` that must fail before
    a `ready` worker says `degraded` (a busy vLLM on few cores sometimes answers /metrics
    late once; a launched engine that exits is `degraded` at once, whatever this says);
    `good_probes_to_recover`: probes in a row that must succeed before a `degraded` worker
    is `ready` again (so that an engine whose /health flaps is not advertised);
    `stuck_after_s`: how long an engine may hold requests without running a step before
    the worker says `degraded` (worker.progress)."""

    interval_s: float
    ttl_s: float
    max_backoff_s: float = 2.0
    failed_probes_to_degrade: int = 2
    probe_window: int = 4
    good_probes_to_recover: int = 3
    stuck_after_s: float = STUCK_AFTER_S


def jittered(interval_s: float, rng: random.Random, fraction: float = JITTER_FRACTION) -> float:
    """`interval_s` scaled by a uniform factor in [1 - fraction, 1 + fraction]."""
    return interval_s * rng.uniform(1.0 - fraction, 1.0 + fraction)


def backoff_s(failures: int, interval_s: float, cap_s: float) -> float:
    """Delay before the next attempt after `failures` consecutive Redis failures."""
    return float(min(cap_s, interval_s * 2 ** min(failures, 16)))


def build_heartbeat(
    identity: WorkerIdentity,
    view: EngineView,
    *,
    state: LifecycleState,
    performance: Performance,
    seq: int,
    sent_at_s: float,
    ttl_s: float,
    stuck_for_s: float | None = None,
) -> Heartbeat:
    """A heartbeat from what is known of the engine (zero load before the first scrape).

    An engine without a KV usage gauge reports 0.0 with `engine.kv_usage_metric = None`;
    that None, not the 0.0, is what a reader must check before trusting KV usage.
    """
    metrics = view.metrics
    models = view.models or ServedModels((), ())
    return Heartbeat(
        worker_id=identity.worker_id,
        region=identity.region,
        endpoint=identity.endpoint,
        models=models.models,
        lora_adapters=models.lora_adapters,
        state=state,
        capacity=Capacity(
            # vLLM's --max-num-seqs is per engine; a data-parallel server runs several.
            max_num_seqs=min(MAX_SEQS, identity.max_num_seqs
                             * (metrics.engine_count if metrics else 1)),
            kv_blocks_total=metrics.kv_blocks_total if metrics else None,
            block_size_tokens=metrics.block_size_tokens if metrics else None,
            max_model_len=models.max_model_len,
        ),
        load=Load(
            running=metrics.running if metrics else 0,
            waiting=metrics.waiting if metrics else 0,
            kv_cache_usage=metrics.kv_cache_usage if metrics is not None else None,
        ),
        performance=performance,
        engine=EngineInfo(
            kind="sim" if view.version and view.version.simulator else identity.engine_kind,
            version=view.version.version if view.version else None,
            kv_usage_metric=metrics.kv_usage_metric if metrics else None,
            metric_names=metrics.metric_names if metrics else (),
            stuck_for_s=stuck_for_s,
        ),
        seq=seq,
        sent_at_s=sent_at_s,
        ttl_s=ttl_s,
    )


@dataclass(frozen=True)
class Beat:
    """One turn of the loop: what the probe saw, what was sent, and whether Redis took it."""

    probe: ProbeResult
    heartbeat: Heartbeat
    published: bool


class HeartbeatLoop:
    """Probes and publishes until cancelled. Cancel the task running `run()` to stop it."""

    def __init__(
        self,
        identity: WorkerIdentity,
        prober: Prober,
        publisher: Publisher,
        timing: HeartbeatTiming,
        *,
        engine_process: EngineProcess | None = None,
        rng: random.Random | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        wall_clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._identity = identity
        self._prober = prober
        self._publisher = publisher
        self._timing = timing
        self._engine_process = engine_process
        self._rng = rng or random.Random()
        self._sleep = sleep
        self._wall_clock = wall_clock
        self._monotonic = monotonic
        self._lifecycle = Lifecycle(
            identity.worker_id, failures_to_degrade=timing.failed_probes_to_degrade,
            window=timing.probe_window, goods_to_recover=timing.good_probes_to_recover,
            monotonic=monotonic)
        self._draining = False
        self._seq = 0
        self._view = EngineView()
        self._tracker = PerformanceTracker()
        # (a beat later than twice the interval counts as two intervals, at least 2 s)
        self._progress = ProgressWatch(timing.stuck_after_s,
                                       max_gap_s=max(2.0, 2 * timing.interval_s))
        self._stuck_for_s: float | None = None
        self._performance = Performance()
        self._wake = asyncio.Event()
        self._beat_done = asyncio.Event()
        self._last_beat: Beat | None = None
        self._failures = 0
        self._outage_started: float | None = None
        self._unpublished = 0
        self._warned_no_kv = False
        self._last_sent_at_s = -float("inf")
        self._clock_behind = False

    @property
    def state(self) -> LifecycleState:
        return self._lifecycle.state

    def begin_drain(self) -> None:
        """From now on publish `draining`, starting with a heartbeat sent right away."""
        self._draining = True
        self._wake.set()

    def wake(self) -> None:
        """Send the next heartbeat now rather than at the end of the interval (the
        supervisor calls this when the engine process starts, crashes or comes back)."""
        self._wake.set()

    async def next_beat(self) -> Beat:
        """Wait until the next heartbeat has been published (or has failed to be)."""
        await self._beat_done.wait()
        assert self._last_beat is not None
        return self._last_beat

    async def run(self) -> None:
        while True:
            started = self._monotonic()
            await self.beat()
            if self._failures:
                delay = jittered(
                    backoff_s(self._failures, self._timing.interval_s, self._timing.max_backoff_s),
                    self._rng,
                )
            else:
                delay = jittered(self._timing.interval_s, self._rng)
            await self._pause(delay - (self._monotonic() - started))

    async def beat(self) -> Beat:
        """Probe, then publish one heartbeat. Engine and Redis failures do not raise."""
        probe = await self._prober.probe()
        self._observe(probe)
        heartbeat = build_heartbeat(
            self._identity,
            self._view,
            state=self._lifecycle.state,
            performance=self._performance,
            seq=self._seq,
            sent_at_s=self.sent_at_s(),
            ttl_s=self._timing.ttl_s,
            stuck_for_s=self._stuck_for_s,
        )
        self._seq += 1
        try:
            await self._publisher.publish(heartbeat)
        except RedisUnavailableError as exc:
            self._on_outage(exc)
            self._last_beat = Beat(probe, heartbeat, published=False)
        else:
            self._on_published()
            self._last_beat = Beat(probe, heartbeat, published=True)
        done, self._beat_done = self._beat_done, asyncio.Event()
        done.set()
        return self._last_beat

    def _observe(self, probe: ProbeResult) -> None:
        self._view = self._view.merge(probe)
        if probe.metrics is not None:
            self._performance = self._tracker.update(probe.metrics)
            # (A probe without /metrics keeps the last verdict: it degrades on its own.)
            self._stuck_for_s = self._progress.observe(probe.metrics, self._monotonic())
            if probe.metrics.kv_usage_metric is None and not self._warned_no_kv:
                self._warned_no_kv = True
                log.warning(
                    "engine exposes neither vllm:kv_cache_usage_perc nor "
                    "vllm:gpu_cache_usage_perc; heartbeats say kv_usage_metric=None"
                )
        engine_down = self._engine_process is not None and self._engine_process.down
        self._lifecycle.advance(probe, self._view, draining=self._draining,
                                engine_down=engine_down, stuck_for_s=self._stuck_for_s,
                                stuck_engines=self._progress.stuck_engines)

    def sent_at_s(self) -> float:
        """The wall-clock time for the next heartbeat, never earlier than the last one's
        plus SENT_AT_STEP_S. Routers keep a worker's report only if its (sent_at_s, seq)
        is greater than the last one's, so after the clock steps back (NTP, a VM restore)
        heartbeats would look older than those already sent and be ignored until those
        expire; instead `sent_at_s` advances by SENT_AT_STEP_S a beat until the clock
        catches up. Across a restart of the agent this does not hold: its first heartbeats
        after a step back may be ignored for up to a TTL."""
        now = self._wall_clock()
        behind = now < self._last_sent_at_s
        if behind and not self._clock_behind:
            log.warning("wall clock stepped back %.3f s; heartbeats keep their send time "
                        "increasing until it catches up", self._last_sent_at_s - now)
        self._clock_behind = behind
        self._last_sent_at_s = max(now, self._last_sent_at_s + SENT_AT_STEP_S)
        return self._last_sent_at_s

    def _on_outage(self, exc: RedisUnavailableError) -> None:
        self._failures += 1
        self._unpublished += 1
        if self._outage_started is None:
            self._outage_started = self._monotonic()
            log.warning("redis unreachable, heartbeats are not reaching routers (%s); "
                        "retrying every %.1f s at most", exc, self._timing.max_backoff_s)

    def _on_published(self) -> None:
        if self._outage_started is not None:
            log.warning("redis reachable again after %.1f s; %d heartbeats were not published",
                        self._monotonic() - self._outage_started, self._unpublished)
        self._failures = 0
        self._outage_started = None
        self._unpublished = 0

    async def _pause(self, delay_s: float) -> None:
        """Sleep `delay_s`, or less if `begin_drain` wakes the loop."""
        if delay_s > 0:
            await unless_set(self._wake, self._sleep(delay_s))
        self._wake.clear()


async def unless_set(event: asyncio.Event, work: Awaitable[_T]) -> _T | None:
    """`work`'s result, or None if `event` is set first; `work` is then cancelled and
    awaited, so that no task is left pending (and nothing warns that one was destroyed)."""
    task = asyncio.ensure_future(work)
    stop = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait((task, stop), return_when=asyncio.FIRST_COMPLETED)
    finally:
        task.cancel()
        stop.cancel()
        await asyncio.gather(task, stop, return_exceptions=True)
    return None if task.cancelled() else task.result()
