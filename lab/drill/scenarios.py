"""The faults a drill injects, one class each, registered by name where it is defined.

A scenario knows its target (what it breaks), how to inject the fault, how to keep it
going (most faults just last; a flapping worker keeps dying), and how to clear it so that
the `after` phase shows the recovery.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import yaml

from lab.devstack.cluster import ValkeyCluster
from lab.devstack.sentinel import SentinelGroup
from lab.devstack.stack import LocalStack
from lab.drill.analysis import Target

DrainVia = Literal["sigterm", "admin", "config"]
RedisMode = Literal["stop", "freeze"]


@dataclass(frozen=True)
class FaultSettings:
    """Knobs of the faults (the CLI's flags)."""

    region: str
    drain_via: DrainVia = "sigterm"
    extra_rtt_ms: float = 300.0
    slow_factor: float = 1.0
    redis_mode: RedisMode = "stop"
    flap_down_s: float = 1.0
    flap_up_s: float = 2.0


@dataclass
class DrillContext:
    """What a scenario acts on, and where it notes what it did (for the report and plot)."""

    stack: LocalStack
    settings: FaultSettings
    t0_s: float
    say: Callable[[str], None]
    clock: Callable[[], float] = time.monotonic
    events: list[tuple[float, str]] = field(default_factory=list)
    sentinel: SentinelGroup | None = None  # the Redis of a scenario that `needs_sentinel`
    cluster: ValkeyCluster | None = None  # the Redis of a scenario that `needs_cluster`

    def now_s(self) -> float:
        return self.clock() - self.t0_s

    def mark(self, label: str) -> None:
        at = self.now_s()
        self.events.append((round(at, 3), label))
        self.say(f"t={at:6.2f}s  {label}")


class Scenario:
    name: ClassVar[str]
    summary: ClassVar[str]
    registry: ClassVar[dict[str, type[Scenario]]] = {}
    # Default length of the fault (s); `--duration-s` overrides, `--quick` uses quick_fault_s.
    fault_s: ClassVar[float] = 30.0
    quick_fault_s: ClassVar[float] = 6.0
    # The stack's Redis is a Sentinel group (a primary, a replica, three sentinels), not
    # the embedded Valkey.
    needs_sentinel: ClassVar[bool] = False
    # The stack's Redis is a Valkey Cluster (three primaries, a replica each).
    needs_cluster: ClassVar[bool] = False

    def __init_subclass__(cls, *, name: str, summary: str, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls.name = name
        cls.summary = summary
        Scenario.registry[name] = cls

    def __init__(self, context: DrillContext) -> None:
        self.context = context
        self.stack = context.stack
        self.region = context.settings.region

    def target(self) -> Target:
        return Target(regions=frozenset({self.region}))

    def describe(self) -> str:
        return self.summary

    async def inject(self) -> None:
        raise NotImplementedError

    async def hold(self, until_s: float) -> None:
        """Keep the fault going until `until_s` (seconds since the load started)."""
        await asyncio.sleep(max(0.0, until_s - self.context.now_s()))

    async def clear(self) -> None:
        raise NotImplementedError


class KillRegion(Scenario, name="kill-region",
                 summary="SIGKILL every engine of the region; restart them when cleared"):
    async def inject(self) -> None:
        self.context.mark(f"SIGKILL all engines of {self.region}")
        killed = await self.stack.kill_region(self.region)
        self.context.say(f"          killed {', '.join(f'{c.name} (pid {c.pid})' for c in killed)}")

    async def clear(self) -> None:
        self.context.mark(f"restart the engines of {self.region}")
        await asyncio.gather(*(self.stack.restart(c) for c in self.stack.by_role("sim", self.region)
                               if not c.running))
        self.context.mark(f"engines of {self.region} listening again")


class DrainRegion(Scenario, name="drain-region",
                  summary="drain the region (SIGTERM its worker agents, or the admin API)"):
    def describe(self) -> str:
        via = self.context.settings.drain_via
        if via == "admin":
            return "drain the region with POST /admin/drain; undrain when cleared"
        if via == "config":
            return ("set `drain: true` on the region in the routers' regions.yaml (hot "
                    "reload); set it back when cleared")
        return ("SIGTERM every worker agent of the region (they drain and leave); "
                "start them again when cleared")

    async def inject(self) -> None:
        via = self.context.settings.drain_via
        if via == "admin":
            self.context.mark(f"POST /admin/drain region {self.region}")
            await self.stack.admin("/admin/drain", {"region": self.region, "reason": "drill"})
            return
        if via == "config":
            self.context.mark(f"regions.yaml: regions.{self.region}.drain = true")
            self._set_config_drain(True)
            return
        self.context.mark(f"SIGTERM the worker agents of {self.region}")
        self.stack.drain(self.stack.by_role("worker", self.region))

    def _set_config_drain(self, drained: bool) -> None:
        # The drill's own copy of the config (run_drill makes one for this mode); written
        # whole and renamed into place, so that the router never reads half a file.
        path = self.stack.config_path
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
        document["regions"][self.region]["drain"] = drained
        partial = path.with_name(path.name + ".partial")
        partial.write_text(yaml.safe_dump(document, sort_keys=False))
        partial.replace(path)

    async def clear(self) -> None:
        via = self.context.settings.drain_via
        if via == "admin":
            self.context.mark(f"POST /admin/undrain region {self.region}")
            await self.stack.admin("/admin/undrain", {"region": self.region})
            return
        if via == "config":
            self.context.mark(f"regions.yaml: regions.{self.region}.drain = false")
            self._set_config_drain(False)
            return
        workers = self.stack.by_role("worker", self.region)
        if not await self.stack.wait_exited(workers, 10.0):
            self.context.say("          some agents are still draining after 10 s")
        self.context.mark(f"start the worker agents of {self.region} again")
        await asyncio.gather(*(self.stack.restart(w) for w in workers if not w.running))
        self.context.mark(f"worker agents of {self.region} running again")


class PartitionRegion(Scenario, name="partition-region",
                      summary="blackhole the network path to the region's engines; heal"):
    async def inject(self) -> None:
        self.context.mark(f"partition {self.region} (blackhole)")
        await self.stack.set_network(self.region, partition=True)

    async def clear(self) -> None:
        self.context.mark(f"heal the partition of {self.region}")
        await self.stack.set_network(self.region, partition=False)


class SlowRegion(Scenario, name="slow-region",
                 summary="add RTT to the region's network path (and optionally slow its "
                         "engines); restore"):
    def describe(self) -> str:
        settings = self.context.settings
        text = f"add {settings.extra_rtt_ms:g} ms RTT to the path to the region"
        if settings.slow_factor != 1.0:
            text += f" and slow its engines x{settings.slow_factor:g}"
        return text + "; restore when cleared"

    async def inject(self) -> None:
        settings = self.context.settings
        self.context.mark(f"slow {self.region}: +{settings.extra_rtt_ms:g} ms RTT"
                          + (f", engines x{settings.slow_factor:g}"
                             if settings.slow_factor != 1.0 else ""))
        await self.stack.set_network(self.region, extra_rtt_ms=settings.extra_rtt_ms)
        if settings.slow_factor != 1.0:
            await self._engines(settings.slow_factor)

    async def clear(self) -> None:
        self.context.mark(f"restore {self.region}")
        await self.stack.set_network(self.region, extra_rtt_ms=0.0)
        if self.context.settings.slow_factor != 1.0:
            await self._engines(1.0)

    async def _engines(self, factor: float) -> None:
        await asyncio.gather(*(self.stack.set_sim_faults(sim, slow_factor=factor)
                               for sim in self.stack.by_role("sim", self.region)))


class RedisOutage(Scenario, name="redis-outage",
                  summary="stop Redis (or freeze it: a blackholed server); start it again"):
    quick_fault_s = 8.0

    def target(self) -> Target:
        return Target()

    def describe(self) -> str:
        if self.context.settings.redis_mode == "freeze":
            return ("SIGSTOP Valkey (connections hang, like a partitioned server); "
                    "SIGCONT when cleared")
        return "stop Valkey (its data is lost); start it again on the same port when cleared"

    async def inject(self) -> None:
        if self.context.settings.redis_mode == "freeze":
            self.context.mark("freeze Redis (SIGSTOP)")
            self.stack.freeze_redis()
            return
        self.context.mark("stop Redis")
        await self.stack.stop_redis()

    async def clear(self) -> None:
        if self.context.settings.redis_mode == "freeze":
            self.context.mark("thaw Redis (SIGCONT)")
            self.stack.thaw_redis()
            return
        self.context.mark("start Redis again (same port, empty)")
        await self.stack.start_redis()
        self.context.mark("Redis answering again")


class WorkerFlap(Scenario, name="worker-flap",
                 summary="one engine keeps dying (SIGKILL) and coming back"):
    quick_fault_s = 12.0  # room for three kills
    def __init__(self, context: DrillContext) -> None:
        super().__init__(context)
        self.sim_name = self.stack.by_role("sim", self.region)[0].name
        self.cycles = 0
        self.comebacks = 0  # restarts while the fault lasts (not the final one)

    def target(self) -> Target:
        return Target(workers=frozenset({self.sim_name.removeprefix("sim-")}))

    def describe(self) -> str:
        settings = self.context.settings
        return (f"SIGKILL the engine of {self.sim_name.removeprefix('sim-')}, restart it "
                f"{settings.flap_down_s:g} s later, kill it again {settings.flap_up_s:g} s "
                "after it is back; repeat while the fault lasts")

    async def inject(self) -> None:
        await self._kill()

    async def _kill(self) -> None:
        self.cycles += 1
        sim = self.stack.child(self.sim_name)
        self.context.mark(f"flap {self.cycles}: SIGKILL {sim.name}")
        await self.stack.kill([sim])

    async def hold(self, until_s: float) -> None:
        settings = self.context.settings
        while True:
            await asyncio.sleep(max(0.0, min(settings.flap_down_s,
                                             until_s - self.context.now_s())))
            if self.context.now_s() >= until_s:
                return
            await self.stack.restart(self.stack.child(self.sim_name))
            self.comebacks += 1
            self.context.mark(f"flap {self.cycles}: {self.sim_name} back")
            await asyncio.sleep(max(0.0, min(settings.flap_up_s, until_s - self.context.now_s())))
            if self.context.now_s() >= until_s:
                return
            await self._kill()

    async def clear(self) -> None:
        sim = self.stack.child(self.sim_name)
        if not sim.running:
            await self.stack.restart(sim)
        self.context.mark(f"flapping ends; {self.sim_name} stays up")
