"""The worker agent: heartbeats until told to stop, then drains and leaves the pool.

SIGTERM or SIGINT begins a drain: the next heartbeat says `draining` (sent at once, so
routers stop sending new requests), heartbeats continue until one saying `draining` was
published and, after it, the engine has no request running or waiting, and then the
heartbeat is deleted and `gone:<id>` is published. The drain deadline bounds the wait
(logged if it passes before routers could have heard of the drain). A second signal
stops waiting for in-flight requests.

With `launch` the agent also runs the engine (worker.supervisor): heartbeats say
`starting` until it is healthy and `degraded` while it is down between restarts; after
the drain and the removal of the heartbeat the engine is stopped, so that nothing the
agent started outlives it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass, field

from worker.heartbeat import HeartbeatLoop, HeartbeatTiming, WorkerIdentity, unless_set
from worker.heartbeat_keys import HeartbeatKeys
from worker.probe import EngineProber, open_engine_session
from worker.publisher import HeartbeatPublisher, RedisUnavailableError
from worker.redis_client import connect, is_cluster_url
from worker.schema import LifecycleState
from worker.supervisor import (
    EngineCommand,
    EngineGaveUpError,
    EngineSupervisor,
    RestartPolicy,
    http_health_check,
)

log = logging.getLogger(__name__)

DRAIN_SIGNALS = (signal.SIGTERM, signal.SIGINT)
UNREACHABLE_BEATS_END_DRAIN = 2


@dataclass(frozen=True)
class AgentSettings:
    """Everything one worker agent needs; built by the CLI from flags and regions.yaml."""

    identity: WorkerIdentity
    engine_url: str
    redis_url: str
    key_prefix: str
    timing: HeartbeatTiming
    drain_timeout_s: float = 30.0
    probe_timeout_s: float = 1.0
    launch: EngineCommand | None = None
    restart: RestartPolicy = field(default_factory=RestartPolicy)


class WorkerAgent:
    """Runs `beats` until `request_drain`, then drains (bounded by `drain_timeout_s`).

    With an `engine` supervisor the agent also runs it, and stops it after the drain.
    """

    def __init__(
        self,
        beats: HeartbeatLoop,
        publisher: HeartbeatPublisher,
        worker_id: str,
        *,
        drain_timeout_s: float,
        engine: EngineSupervisor | None = None,
    ) -> None:
        self._beats = beats
        self._publisher = publisher
        self._worker_id = worker_id
        self._drain_timeout_s = drain_timeout_s
        self._engine = engine
        self._drain_requested = asyncio.Event()
        self._hurry = asyncio.Event()

    def request_drain(self, reason: str = "drain requested") -> None:
        """Begin draining; a second request skips waiting for in-flight requests."""
        if self._drain_requested.is_set():
            log.warning("%s during drain: not waiting for in-flight requests", reason)
            self._hurry.set()
            return
        log.info("%s: draining worker %s", reason, self._worker_id)
        self._drain_requested.set()

    async def run(self) -> int:
        """Heartbeat, drain when asked, remove the heartbeat, stop a launched engine.

        Returns the exit code: 0, or 1 when the launched engine was given up on. An
        unexpected error in the heartbeat loop propagates; the heartbeat then expires
        within its TTL instead of being removed (a launched engine is stopped all the same).
        """
        supervising = (
            None if self._engine is None
            else asyncio.create_task(self._engine.run(), name="engine-supervisor")
        )
        try:
            code = await self._serve(supervising)
            try:
                await self._publisher.remove(self._worker_id)
            except RedisUnavailableError as exc:
                log.warning("%s; routers drop the worker when its heartbeat expires", exc)
            else:
                log.info("worker %s %s and removed from the pool", self._worker_id,
                         "drained" if code == 0 else "left")
            return code
        finally:
            if supervising is not None:
                await self._stop_engine(supervising)

    async def _serve(self, supervising: asyncio.Task[None] | None) -> int:
        beating = asyncio.create_task(self._beats.run(), name="heartbeat-loop")
        asked = asyncio.create_task(self._drain_requested.wait(), name="drain-requested")
        watched = [beating, asked] if supervising is None else [beating, asked, supervising]
        try:
            await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
            if beating.done():
                beating.result()
                raise RuntimeError("the heartbeat loop ended on its own")
            if supervising is not None and supervising.done():
                error = supervising.exception() or RuntimeError("the supervisor ended")
                log.error("%s; worker %s leaves the pool", error, self._worker_id)
                return 1
            self._beats.begin_drain()
            await self._drain()
            return 0
        finally:
            beating.cancel()
            asked.cancel()
            await asyncio.gather(beating, asked, return_exceptions=True)

    async def _stop_engine(self, supervising: asyncio.Task[None]) -> None:
        assert self._engine is not None
        if not supervising.done():
            await self._engine.stop()
        outcome = (await asyncio.gather(supervising, return_exceptions=True))[0]
        if isinstance(outcome, BaseException) and not isinstance(
            outcome, EngineGaveUpError | asyncio.CancelledError
        ):
            log.error("engine supervisor failed: %r", outcome)

    async def _drain(self) -> None:
        # Only a probe taken after a `draining` heartbeat went out can show that no request
        # a router sent before it saw that heartbeat is still on its way to the engine; one
        # that Redis did not take (down, full) told no router anything.
        announced = False
        in_flight: int | None = None
        unreachable = 0
        try:
            async with asyncio.timeout(self._drain_timeout_s):
                while True:
                    beat = await unless_set(self._hurry, self._beats.next_beat())
                    if beat is None:
                        return
                    metrics = beat.probe.metrics
                    if metrics is not None:
                        unreachable = 0
                        in_flight = metrics.in_flight
                        if announced and in_flight == 0:
                            return
                    elif not beat.probe.engine_ok:
                        # An engine that stays unreachable (stopped or crashed) has nothing
                        # left to finish: waiting out the deadline would only delay shutdown,
                        # whether or not routers heard of the drain (with Redis gone too, as
                        # when `globalpool up` is killed, no `draining` heartbeat ever goes
                        # out). A launched engine whose process still runs is busy, not
                        # gone: it may be streaming the very requests the drain waits for.
                        unreachable += 1
                        if (unreachable >= UNREACHABLE_BEATS_END_DRAIN
                                and (self._engine is None or self._engine.down)):
                            log.warning("engine unreachable while draining; not waiting%s",
                                        "" if announced else " (no `draining` heartbeat "
                                        "was published: Redis unreachable)")
                            return
                    announced = announced or (
                        beat.published and beat.heartbeat.state is LifecycleState.DRAINING)
        except TimeoutError:
            if not announced:
                log.error("drain timed out after %.1f s and no `draining` heartbeat was "
                          "published (Redis unreachable): routers may send worker %s "
                          "requests until its last heartbeat expires",
                          self._drain_timeout_s, self._worker_id)
                return
            log.warning("drain timed out after %.1f s with %s requests still in flight",
                        self._drain_timeout_s, "unknown" if in_flight is None else in_flight)


async def serve(
    settings: AgentSettings, *, announce: Callable[[], None] | None = None
) -> int:
    """Run one agent with signal handlers installed; returns the process exit code.

    `announce` runs once everything is wired, before the first heartbeat (and before a
    launched engine starts).
    """
    loop = asyncio.get_running_loop()
    publisher = HeartbeatPublisher(connect(settings.redis_url), HeartbeatKeys(
        settings.key_prefix, sharded=is_cluster_url(settings.redis_url)))
    try:
        async with open_engine_session(settings.probe_timeout_s) as session:
            engine = None
            if settings.launch is not None:
                engine = EngineSupervisor(
                    settings.launch, settings.restart,
                    http_health_check(session, f"{settings.engine_url}/health"),
                    # Routers learn of a crash or a recovery at once, not an interval later.
                    on_change=lambda _state: beats.wake(),
                )
            beats = HeartbeatLoop(
                settings.identity,
                EngineProber(session, settings.engine_url),
                publisher,
                settings.timing,
                engine_process=engine,
            )
            agent = WorkerAgent(
                beats, publisher, settings.identity.worker_id,
                drain_timeout_s=settings.drain_timeout_s, engine=engine,
            )
            for sig in DRAIN_SIGNALS:
                loop.add_signal_handler(sig, agent.request_drain, sig.name)
            try:
                if announce is not None:
                    announce()
                return await agent.run()
            finally:
                for sig in DRAIN_SIGNALS:
                    loop.remove_signal_handler(sig)
    finally:
        await publisher.aclose()
