"""One cell of the matrix: a worker fault crossed with a client behaviour, on one lane.

    fresh router | RSS before | behaviour.open | fault on | load_s of requests | all ended
    | behaviour.close | settle | arrivals, events, RSS after | fault off

The load is open loop: the behaviour's requests at `behaviour_rate_per_s` and, beside them,
witness requests (normal clients) at `witness_rate_per_s`, streams and whole answers, chat
and completions in turn. The witnesses make every cell measure detection and loss the same
way, also when the behaviour's own clients leave before any answer (the router then learns
nothing from them). Every request is bounded by the clients' deadline, so a cell lasts at
most load_s + deadline_s + a few seconds.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

from lab.drill.hostile.behaviours import Normal
from lab.drill.hostile.clients import ClientBehaviour, ClientSettings, Outcome, RequestPlan
from lab.drill.hostile.lane import Lane


@dataclass(frozen=True)
class CellSettings:
    load_s: float = 6.0
    behaviour_rate_per_s: float = 3.0
    # Enough for the bad worker to see a request every second or so, whatever the behaviour.
    witness_rate_per_s: float = 5.0
    settle_s: float = 0.5  # after the last request: the router notices the clients left
    slow_token_interval_s: float = 5.0


@dataclass
class CellRun:
    """What one cell did and observed, before any judgement (lab.drill.hostile.measure)."""

    fault: str
    client: str
    lane: int
    bad_worker: str
    fault_unix_s: float
    load_end_unix_s: float
    outcomes: list[Outcome]
    arrivals_unix_s: list[float]
    arrivals_total: int
    router_events: list[dict[str, Any]]
    rss_mb_before: float
    rss_mb_after: float
    rss_mb_peak: float
    max_loop_lag_s: float  # how late the clients' event loop ran: the machine's stalls
    wall_s: float
    facts: dict[str, Any] = field(default_factory=dict)


async def run_cell(lane: Lane, fault: str, client: str, settings: CellSettings,
                   clients: ClientSettings) -> CellRun:
    started = time.monotonic()
    await lane.fresh_router()
    await lane.warm_up()
    rss_before, _ = lane.router_memory_mb()
    behaviour = ClientBehaviour.registry[client](clients)
    witness = Normal(clients)
    await behaviour.open(lane.endpoint)
    try:
        await lane.set_fault(fault, slow_token_interval_s=settings.slow_token_interval_s)
        arrivals_since = (await lane.arrivals())["since_unix_s"]
        load_end_unix_s = time.time() + settings.load_s
        with LoopLag() as lag:
            outcomes = await _load(lane, behaviour, witness, settings, f"{fault}/{client}")
    finally:
        await behaviour.close()
    await asyncio.sleep(settings.settle_s)
    arrivals = await lane.arrivals()
    events = await lane.router_events()
    rss_after, rss_peak = lane.router_memory_mb()
    await lane.set_fault("none")
    return CellRun(
        fault=fault, client=client, lane=lane.index, bad_worker=lane.bad_worker_id,
        fault_unix_s=arrivals_since, load_end_unix_s=load_end_unix_s, outcomes=outcomes,
        arrivals_unix_s=arrivals["arrivals_unix_s"],
        arrivals_total=arrivals["completion_requests"], router_events=events,
        rss_mb_before=rss_before, rss_mb_after=rss_after, rss_mb_peak=rss_peak,
        max_loop_lag_s=round(lag.max_s, 3),
        wall_s=round(time.monotonic() - started, 2), facts=behaviour.cell_facts())


class LoopLag:
    """The longest this event loop ran a timer late while the block ran: on a machine
    shared with other work, a stall of the whole host (the clients, the router and the
    workers alike) shows here, and timeouts measured then measure the host."""

    TICK_S = 0.1

    def __init__(self) -> None:
        self.max_s = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.TICK_S
            await asyncio.sleep(self.TICK_S)
            self.max_s = max(self.max_s, loop.time() - due)

    def __enter__(self) -> LoopLag:
        self._task = asyncio.create_task(self._watch())
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._task is not None:
            self._task.cancel()


async def _load(lane: Lane, behaviour: ClientBehaviour, witness: ClientBehaviour,
                settings: CellSettings, seed: str) -> list[Outcome]:
    """Start every request on its schedule; return when all have ended. `seed`: the same
    mix of requests for the same cell on every run."""
    rng = random.Random(seed)
    schedule = sorted(
        [(i / settings.behaviour_rate_per_s, behaviour, RequestPlan.mixed(i, "behaviour", rng))
         for i in range(int(settings.load_s * settings.behaviour_rate_per_s))]
        + [((i + 0.5) / settings.witness_rate_per_s, witness,
            RequestPlan.mixed(i, "witness", rng))
           for i in range(int(settings.load_s * settings.witness_rate_per_s))],
        key=lambda item: item[0])
    loop = asyncio.get_running_loop()
    start = loop.time()
    tasks: list[asyncio.Task[Outcome]] = []
    for offset_s, sender, plan in schedule:
        await asyncio.sleep(max(0.0, start + offset_s - loop.time()))
        tasks.append(asyncio.create_task(sender.send(lane.endpoint, plan)))
    return list(await asyncio.gather(*tasks))
