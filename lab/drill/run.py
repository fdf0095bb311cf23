"""`globalpool drill`: bring the stack up, load it, inject a fault, measure, report.

    warmup | before | during (the fault) | after (cleared) |
    0      w        F                    C                 E      seconds since load start

The load runs from 0 to E without a pause; the fault is injected at F and cleared at C.
E is at least C + `after_s`; the load goes on past it until the target serves its share
again (the router sees Redis and every worker again, for a Redis outage), then
`after_return_s` more, so that the `after` phase measures the return and the traffic
back on the target; but no longer than `return_wait_s` from the moment the clear is
done (engines listening, agents running, path healed). Every request is recorded
(lab.devstack.loadgen); the router's /health is polled every 0.25 s and its
/admin/status every second (for its own ejection events).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from lab.devstack.cluster import ValkeyCluster
from lab.devstack.loadgen import LoadGenerator, LoadSpec, LoadTarget, RequestResult
from lab.devstack.sentinel import SentinelGroup
from lab.devstack.stack import LocalStack
from lab.devstack.valkey import free_port
from lab.drill import analysis
from lab.drill.analysis import Timeline
from lab.drill.report import DrillFacts, build_report, write_outputs
from lab.drill.scenarios import DrillContext, FaultSettings, Scenario
from router.config_loader import load_config

_POLL = aiohttp.ClientTimeout(total=1.0)


@dataclass(frozen=True)
class DrillOptions:
    scenario: str
    out: Path
    config_path: Path
    settings: FaultSettings
    fault_s: float
    warmup_s: float = 3.0
    before_s: float = 10.0
    after_s: float = 20.0  # the least the load goes on after the clear (see the module doc)
    after_return_s: float = 3.0  # load after the return is seen
    return_wait_s: float = 60.0  # the longest wait for the return once the clear is done
    rate_per_s: float = 20.0
    max_tokens: int = 16
    request_timeout_s: float = 60.0
    seed: int = 0
    overrides: tuple[str, ...] = ()
    command: str = ""

    @property
    def timeline(self) -> Timeline:
        """The schedule as planned: the load ends at `end_s` at the earliest."""
        fault = self.warmup_s + self.before_s
        cleared = fault + self.fault_s
        return Timeline(warmup_end_s=self.warmup_s, fault_s=fault, cleared_s=cleared,
                        end_s=cleared + self.after_s)


class _Observer:
    """Polls the router while the drill runs; prints progress every few seconds."""

    def __init__(self, stack: LocalStack, generator: LoadGenerator, context: DrillContext,
                 timeline: Timeline) -> None:
        self.stack = stack
        self.generator = generator
        self.context = context
        self.timeline = timeline
        self.health: list[dict[str, Any]] = []
        self.router_events: dict[tuple[Any, ...], dict[str, Any]] = {}
        self.t0_unix_s = time.time() - (time.monotonic() - context.t0_s)

    async def run(self) -> None:
        async with aiohttp.ClientSession(timeout=_POLL) as session:
            await asyncio.gather(self._health(session), self._admin(session), self._progress())

    async def _health(self, session: aiohttp.ClientSession) -> None:
        while True:
            poll: dict[str, Any] = {"t_s": round(self.context.now_s(), 3)}
            try:
                async with session.get(f"{self.stack.router_url}/health") as response:
                    poll.update(await response.json())
            except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
                poll["error"] = type(exc).__name__
            self.health.append(poll)
            await asyncio.sleep(0.25)

    async def _admin(self, session: aiohttp.ClientSession) -> None:
        headers = {"Authorization": f"Bearer {self.stack.admin_token}"}
        while True:
            await asyncio.sleep(1.0)
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError):
                async with session.get(f"{self.stack.router_url}/admin/status",
                                       headers=headers) as response:
                    if response.status != 200:
                        continue  # no admin API in this build: events stay empty
                    status = await response.json()
                for event in status.get("events", []):
                    at = event.get("at_unix_s")
                    if not isinstance(at, int | float):
                        continue
                    key = (round(at, 3), event.get("kind"), event.get("subject"))
                    self.router_events[key] = {
                        "t_s": round(at - self.t0_unix_s, 3), "kind": event.get("kind"),
                        "subject": event.get("subject"), "detail": event.get("detail")}

    async def _progress(self, every_s: float = 3.0) -> None:
        while True:
            await asyncio.sleep(every_s)
            now = self.context.now_s()
            recent = [r for r in self.generator.results
                      if r.end_s - self.context.t0_s >= now - every_s]
            self.context.say(_progress_line(now, self.timeline.phase(now) or "warmup", recent,
                                            self.generator.in_flight, every_s))


def _progress_line(now: float, phase: str, recent: list[RequestResult], in_flight: int,
                   window_s: float) -> str:
    served: dict[str, int] = {}
    for r in recent:
        if r.ok and r.region:
            served[r.region] = served.get(r.region, 0) + 1
    total = sum(served.values()) or 1
    share = " ".join(f"{region} {100 * n / total:3.0f}%" for region, n in sorted(served.items()))
    bfb = sum(r.failure == "before_first_byte" for r in recent)
    mid = sum(r.failure == "mid_stream" for r in recent)
    ttfts = sorted(t for r in recent if r.ok and (t := r.ttft_ms) is not None)
    p99 = f"{ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))]:.0f} ms" if ttfts else "-"
    return (f"t={now:6.2f}s  {phase:<7} {len(recent) / window_s:5.1f} req/s done, "
            f"{in_flight:3d} open | served: {share or '-'} | failed: {bfb} before first "
            f"byte, {mid} mid-stream | retried {sum(r.retried for r in recent)} | "
            f"TTFT p99 {p99}")


def with_overrides(config_path: Path, overrides: Sequence[str], out: Path,
                   *, copy: bool = False) -> Path:
    """`config_path` with `a.b.c=VALUE` settings (VALUE read as YAML) written to `out`.

    The drill's routers then read the written copy; without overrides (and unless `copy`,
    for a drill that edits the file) the file itself.
    """
    if not overrides and not copy:
        return config_path
    document = yaml.safe_load(config_path.read_text(encoding="utf-8"))
    for override in overrides:
        dotted, equals, raw = override.partition("=")
        if not equals or not dotted:
            raise ValueError(f"--set {override!r}: expected PATH=VALUE, e.g. "
                             "router.timeouts.first_byte_s=5")
        node = document
        *parents, leaf = dotted.split(".")
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = yaml.safe_load(raw)
    written = out / "regions.yaml"
    written.write_text(f"# {config_path}, changed by globalpool drill: {' '.join(overrides)}\n"
                       + yaml.safe_dump(document, sort_keys=False))
    return written


async def run_drill(options: DrillOptions, say: Callable[[str], None]) -> dict[str, Any]:
    """Run one drill end to end; returns the report (also written under options.out)."""
    options.out.mkdir(parents=True, exist_ok=True)
    config_path = with_overrides(options.config_path, options.overrides, options.out,
                                 copy=options.settings.drain_via == "config")
    config = load_config(config_path)
    timeline = options.timeline
    say(f"drill {options.scenario}: {options.rate_per_s:g} req/s for {timeline.end_s:g} s "
        f"or more (until the target is back, at most {options.return_wait_s:g} s after the "
        f"clear); fault at t={timeline.fault_s:g}s for {options.fault_s:g} s; "
        f"out: {options.out}")
    sentinel: SentinelGroup | None = None
    cluster: ValkeyCluster | None = None
    if Scenario.registry[options.scenario].needs_cluster:
        started = time.monotonic()
        cluster = await asyncio.to_thread(ValkeyCluster.start, options.out / "redis",
                                          replicas_per_primary=1,
                                          password=secrets.token_urlsafe(16))
        say(f"redis: a Valkey Cluster up in {time.monotonic() - started:.1f} s (primaries "
            f"{', '.join(str(n.port) for n in cluster.primaries)}, a replica each)")
    if Scenario.registry[options.scenario].needs_sentinel:
        started = time.monotonic()
        sentinel = await asyncio.to_thread(SentinelGroup.start, options.out / "redis",
                                           password=secrets.token_urlsafe(16))
        say(f"redis: a Sentinel group up in {time.monotonic() - started:.1f} s (primary "
            f"{sentinel.primary.port}, replica {sentinel.replicas[0].port}, sentinels "
            f"{', '.join(str(s.port) for s in sentinel.sentinels)})")
    stack = LocalStack(
        config, config_path, host="127.0.0.1", port=free_port(),
        log_dir=options.out / "logs",
        redis_url=sentinel.url if sentinel else cluster.url if cluster else None,
        progress=say, netem=True, admin_token=secrets.token_urlsafe(16),
    )
    try:
        return await _run_on(stack, options, timeline, say, sentinel, cluster)
    finally:
        if sentinel is not None:
            await asyncio.to_thread(sentinel.stop)
        if cluster is not None:
            await asyncio.to_thread(cluster.stop)


async def _run_on(stack: LocalStack, options: DrillOptions, timeline: Timeline,
                  say: Callable[[str], None], sentinel: SentinelGroup | None,
                  cluster: ValkeyCluster | None) -> dict[str, Any]:
    started = time.monotonic()
    await stack.start()
    say(f"stack up in {time.monotonic() - started:.1f} s; router {stack.router_url} "
        f"(region {stack.config.router.region}); logs in {stack.log_dir}")
    try:
        return await _drive(options, stack, timeline, say, sentinel, cluster)
    finally:
        say("stopping the stack ...")
        stopping = time.monotonic()
        await stack.stop(timeout_s=5.0)
        say(f"stopped in {time.monotonic() - stopping:.1f} s; no child process left running")


async def _drive(options: DrillOptions, stack: LocalStack, timeline: Timeline,
                 say: Callable[[str], None], sentinel: SentinelGroup | None = None,
                 cluster: ValkeyCluster | None = None) -> dict[str, Any]:
    router_region = stack.router_regions[0]
    # A bound only: the load is stopped when the after phase has what it needs. The clear
    # itself takes time too (a drain waits up to 10 s for the agents to leave).
    longest_s = timeline.end_s + options.return_wait_s + options.after_return_s + 60.0
    spec = LoadSpec(
        targets=[LoadTarget(stack.router_url, origin_region=router_region)],
        duration_s=longest_s, rate_per_s=options.rate_per_s,
        max_requests=int(options.rate_per_s * longest_s) + 10,
        request_timeout_s=options.request_timeout_s, max_tokens=options.max_tokens,
        model=stack.config.models[0], seed=options.seed,
    )
    generator = LoadGenerator(spec)
    load_at_start = os.getloadavg()[0]  # other work on the machine skews latencies
    context = DrillContext(stack=stack, settings=options.settings, t0_s=time.monotonic(),
                           say=say, sentinel=sentinel, cluster=cluster)
    scenario = Scenario.registry[options.scenario](context)
    expected_workers = len(stack.by_role("sim"))
    stop = asyncio.Event()
    load = asyncio.create_task(generator.run(stop))
    await generator.started.wait()
    assert generator.started_at_s is not None
    context.t0_s = generator.started_at_s
    observer = _Observer(stack, generator, context, timeline)
    watching = asyncio.create_task(observer.run())
    try:
        context.mark(f"load starts: {options.rate_per_s:g} req/s of streaming chat, "
                     f"{options.max_tokens} tokens each")
        await asyncio.sleep(max(0.0, timeline.fault_s - context.now_s()))
        await scenario.inject()
        await scenario.hold(timeline.cleared_s)
        await scenario.clear()
        timeline = replace(timeline, end_s=await _after_phase(
            options, timeline, scenario, generator, observer, expected_workers))
        stop.set()
        results = await load
        context.mark(f"load ends: {len(results)} requests")
        await asyncio.sleep(0.5)  # one more admin poll for the last router events
    finally:
        watching.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watching
        if not load.done():
            load.cancel()
    report = build_report(
        facts=DrillFacts.of(scenario), options_json=_options_json(options), timeline=timeline,
        results=results, t0_s=context.t0_s, events=context.events,
        health=observer.health, router_events=sorted(observer.router_events.values(),
                                                     key=lambda e: e["t_s"]),
        expected_workers=expected_workers, skipped=generator.skipped,
        max_start_lag_s=generator.max_start_lag_s,
        exited=[c.name for c in stack.exited()],
    )
    report["regions"] = list(stack.config.regions)
    report["host"] = {"cpus": os.cpu_count(), "load_average_1m_at_end": os.getloadavg()[0],
                      "load_average_1m_at_start": load_at_start}
    write_outputs(options.out, report, results, context.t0_s, observer.health)
    return report


async def _after_phase(options: DrillOptions, timeline: Timeline, scenario: Scenario,
                       generator: LoadGenerator, observer: _Observer,
                       expected_workers: int) -> float:
    """Wait, once the fault is cleared, until the load may end (see the module doc);
    returns that moment (seconds since the load started)."""
    context = scenario.context
    wait_until_s = context.now_s() + options.return_wait_s
    returned_at_s: float | None = None
    while True:
        now_s = context.now_s()
        if returned_at_s is None:
            seen = _return_seen(scenario, timeline, generator, observer, expected_workers)
            if seen is not None:
                returned_at_s = now_s
                context.mark(f"{seen}: load for {options.after_return_s:g} s more")
        if now_s >= timeline.end_s:
            if returned_at_s is not None and now_s >= returned_at_s + options.after_return_s:
                return round(now_s, 2)
            if returned_at_s is None and now_s >= wait_until_s:
                context.mark(f"no return within {options.return_wait_s:g} s of the clear")
                return round(now_s, 2)
        await asyncio.sleep(0.25)


def _return_seen(scenario: Scenario, timeline: Timeline, generator: LoadGenerator,
                 observer: _Observer, expected_workers: int) -> str | None:
    """What the drill has seen return so far (for its events), or None."""
    target = scenario.target()
    if not target:
        _, recovered = analysis.health_times(observer.health, timeline, expected_workers)
        return None if recovered is None else "the router sees Redis and every worker again"
    requests = analysis.relative(generator.results, scenario.context.t0_s)
    if analysis.share_before_fault(requests, target, timeline) == 0:
        return f"{target.label} served nothing before the fault: no return to wait for"
    if analysis.returned(requests, target, timeline, scenario.context.now_s()):
        return f"{target.label} serves its share again"
    return None


def _options_json(options: DrillOptions) -> dict[str, Any]:
    document = asdict(options)
    document["out"] = str(options.out)
    document["config_path"] = str(options.config_path)
    return document


def command_line() -> str:
    return "globalpool " + " ".join(shlex.quote(arg) for arg in sys.argv[1:])

