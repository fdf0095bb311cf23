"""What the engines saw: running + waiting per worker over time, and prefix-cache counters.

Polls every simulator's `/metrics` directly (not through its emulated network) every
`interval_s`. Only the few lines needed are read, by prefix, so a poll costs little:

    vllm:num_requests_running / vllm:num_requests_waiting   (gauges)
    vllm:prefix_cache_queries_total / vllm:prefix_cache_hits_total   (prompt tokens)

The prefix-hit rate of a run is hits / queries over the run (the counters' increase):
the share of prompt tokens whose KV came from the prefix cache instead of prefill.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp

_RUNNING = "vllm:num_requests_running{"
_WAITING = "vllm:num_requests_waiting{"
_QUERIES = "vllm:prefix_cache_queries_total{"
_HITS = "vllm:prefix_cache_hits_total{"


@dataclass(frozen=True, slots=True)
class EngineSample:
    running: int
    waiting: int
    prefix_queries: float
    prefix_hits: float


def parse_engine_metrics(text: str) -> EngineSample:
    """The four values from vLLM/simulator Prometheus text (0 when a line is absent)."""
    values = {_RUNNING: 0.0, _WAITING: 0.0, _QUERIES: 0.0, _HITS: 0.0}
    for line in text.splitlines():
        for prefix in values:
            if line.startswith(prefix):
                values[prefix] += float(line.rsplit(" ", 1)[1])
    return EngineSample(running=round(values[_RUNNING]), waiting=round(values[_WAITING]),
                        prefix_queries=values[_QUERIES], prefix_hits=values[_HITS])


@dataclass(frozen=True, slots=True)
class EngineEndpoint:
    """One simulator to watch: its name, region and direct URL."""

    name: str
    region: str
    url: str


@dataclass
class EngineWatch:
    """Samples every engine until cancelled; `series` holds (t_s, {name: sample})."""

    engines: Sequence[EngineEndpoint]
    interval_s: float = 1.0
    series: list[tuple[float, dict[str, EngineSample]]] = field(default_factory=list)

    async def sample(self, session: aiohttp.ClientSession) -> dict[str, EngineSample]:
        async def one(engine: EngineEndpoint) -> tuple[str, EngineSample | None]:
            try:
                async with session.get(f"{engine.url}/metrics") as response:
                    return engine.name, parse_engine_metrics(await response.text())
            except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
                return engine.name, None

        answers = await asyncio.gather(*(one(engine) for engine in self.engines))
        return {name: sample for name, sample in answers if sample is not None}

    async def run(self, now_s: Callable[[], float]) -> None:
        """Poll until cancelled; `now_s` gives the run's clock (seconds)."""
        timeout = aiohttp.ClientTimeout(total=max(1.0, self.interval_s))
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                at = now_s()
                self.series.append((at, await self.sample(session)))
                await asyncio.sleep(max(0.0, self.interval_s - (now_s() - at)))

    async def snapshot(self) -> dict[str, EngineSample]:
        """One poll of every engine, outside `run` (before and after a replay)."""
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as session:
            return await self.sample(session)

    async def wait_idle(self, timeout_s: float, quiet_s: float) -> bool:
        """Until no engine has running or waiting requests, then `quiet_s` more (so that
        the agents' performance figures from the last run age out of the heartbeats)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            samples = await self.snapshot()
            if len(samples) == len(self.engines) and all(
                    s.running == 0 and s.waiting == 0 for s in samples.values()):
                await asyncio.sleep(quiet_s)
                return True
            await asyncio.sleep(0.25)
        return False


def prefix_hit_rate(before: dict[str, EngineSample], after: dict[str, EngineSample],
                    names: Sequence[str] | None = None) -> float | None:
    """Hits / queries of the counters' increase, over `names` (all engines if None)."""
    queries = hits = 0.0
    for name, end in after.items():
        start = before.get(name)
        if start is None or (names is not None and name not in names):
            continue
        queries += end.prefix_queries - start.prefix_queries
        hits += end.prefix_hits - start.prefix_hits
    return hits / queries if queries > 0 else None
