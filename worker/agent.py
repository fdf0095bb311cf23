"""The worker agent: heartbeats until told to stop, then drains and leaves the pool.

SIGTERM or SIGINT begins a drain: the next heartbeat says `draining` (sent at once, so
routers stop sending new requests), heartbeats continue while the engine still has
requests running or waiting, and then the heartbeat is deleted and `gone:<id>` is
published. A second signal stops waiting for in-flight requests.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass

from worker.heartbeat import HeartbeatLoop, HeartbeatTiming, WorkerIdentity, unless_set
from worker.probe import EngineProber, open_engine_session
from worker.publisher import HeartbeatPublisher, RedisUnavailableError
from worker.redis_client import connect
from worker.schema import HeartbeatKeys, LifecycleState

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


class WorkerAgent:
    """Runs `beats` until `request_drain`, then drains (bounded by `drain_timeout_s`)."""

    def __init__(
        self,
        beats: HeartbeatLoop,
        publisher: HeartbeatPublisher,
        worker_id: str,
        *,
        drain_timeout_s: float,
    ) -> None:
        self._beats = beats
        self._publisher = publisher
        self._worker_id = worker_id
        self._drain_timeout_s = drain_timeout_s
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
        """Heartbeat, drain when asked, remove the heartbeat; returns the exit code (0).

        An unexpected error in the heartbeat loop propagates; the heartbeat then expires
        within its TTL instead of being removed.
        """
        beating = asyncio.create_task(self._beats.run(), name="heartbeat-loop")
        asked = asyncio.create_task(self._drain_requested.wait(), name="drain-requested")
        try:
            await asyncio.wait((beating, asked), return_when=asyncio.FIRST_COMPLETED)
            if beating.done():
                beating.result()
                raise RuntimeError("the heartbeat loop ended on its own")
            self._beats.begin_drain()
            await self._drain()
        finally:
            beating.cancel()
            asked.cancel()
            await asyncio.gather(beating, asked, return_exceptions=True)
        try:
            await self._publisher.remove(self._worker_id)
        except RedisUnavailableError as exc:
            log.warning("%s; routers drop the worker when its heartbeat expires", exc)
        else:
            log.info("worker %s drained and removed from the pool", self._worker_id)
        return 0

    async def _drain(self) -> None:
        # Only a probe taken after a `draining` heartbeat went out can show that no request
        # a router sent before it saw that heartbeat is still on its way to the engine.
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
                        # left to finish: waiting out the deadline would only delay shutdown.
                        unreachable += 1
                        if announced and unreachable >= UNREACHABLE_BEATS_END_DRAIN:
                            log.warning("engine unreachable while draining; not waiting")
                            return
                    announced = announced or beat.heartbeat.state is LifecycleState.DRAINING
        except TimeoutError:
            log.warning("drain timed out after %.1f s with %s requests still in flight",
                        self._drain_timeout_s, "unknown" if in_flight is None else in_flight)


async def serve(
    settings: AgentSettings, *, announce: Callable[[], None] | None = None
) -> int:
    """Run one agent with signal handlers installed; returns the process exit code.

    `announce` runs once everything is wired, before the first heartbeat.
    """
    loop = asyncio.get_running_loop()
    publisher = HeartbeatPublisher(connect(settings.redis_url), HeartbeatKeys(settings.key_prefix))
    try:
        async with open_engine_session(settings.probe_timeout_s) as session:
            beats = HeartbeatLoop(
                settings.identity,
                EngineProber(session, settings.engine_url),
                publisher,
                settings.timing,
            )
            agent = WorkerAgent(
                beats, publisher, settings.identity.worker_id,
                drain_timeout_s=settings.drain_timeout_s,
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
