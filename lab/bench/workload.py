"""Generate a scenario's trace: open-loop arrivals per origin, then each request's content.

Arrivals are Poisson per origin region with a piecewise-constant rate (the scenario's
demand steps, as a multiple of the region's capacity) plus seeded bursts, plus the
synchronized bursts (K requests from every origin at one instant). Contents follow
the workload: a class (interactive or batch), a prompt (plain, behind a shared prefix
group, or a turn of a session that resends its history), and an output length, each
length from a bounded lognormal. Independent random streams (arrivals, bursts, contents,
prefix texts) are seeded from the scenario's seed, so a change to one leaves the others
as they were, and the same seed always gives the same trace.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

from lab.bench.capacity import worker_capacity_rps
from lab.bench.scenario import BoundedLognormal, Scenario, Workload
from lab.bench.trace import Segment, Trace, TraceRequest

CALIBRATION_REQUESTS = 400


def draw(rng: random.Random, spec: BoundedLognormal) -> int:
    """One bounded lognormal draw, rounded to a whole number."""
    value = round(rng.lognormvariate(spec.mu, spec.sigma))
    return min(spec.max, max(spec.min, value))


def _seed(rng: random.Random) -> int:
    return rng.getrandbits(48)


@dataclass
class _Session:
    session_id: str
    preamble: Segment
    planned_turns: int
    messages: list[Segment] = field(default_factory=list)

    @property
    def chars(self) -> int:
        return self.preamble[1] + sum(c for _, c in self.messages) + len(self.messages)


class ContentSource:
    """Draws what each request asks for, in arrival order (sessions live per origin)."""

    def __init__(self, workload: Workload, seed: int) -> None:
        self.workload = workload
        self._rng = random.Random(f"{seed}:contents")
        groups = workload.prefix_groups
        texts = random.Random(f"{seed}:prefix-groups")
        self.groups: list[Segment] = [(_seed(texts), draw(texts, groups.chars))
                                      for _ in range(groups.count)]
        weights = [1.0 / (rank + 1) ** groups.zipf_s for rank in range(groups.count)]
        self._cum_weights = list(itertools.accumulate(weights))
        self._sessions: dict[str, list[_Session]] = {}
        self._session_numbers = itertools.count(1)

    def next(self, index: int, at_s: float, origin: str) -> TraceRequest:
        workload, rng = self.workload, self._rng
        if rng.random() < workload.batch_share:
            return self._shared_or_plain(index, at_s, origin, "batch",
                                         draw(rng, workload.batch_output_tokens),
                                         workload.batch_ttft_budget_ms)
        max_tokens = draw(rng, workload.output_tokens)
        if rng.random() < workload.sessions.share:
            return self._session_turn(index, at_s, origin, max_tokens)
        return self._shared_or_plain(index, at_s, origin, "interactive", max_tokens, None)

    def _preamble(self) -> Segment:
        """A new session's preamble: a text of its own, or a shared system prompt."""
        rng = self._rng
        if self.workload.sessions.shared_preambles:
            return self.groups[self._group()]
        return (_seed(rng), draw(rng, self.workload.prefix_groups.chars))

    def _group(self) -> int:
        return self._rng.choices(range(len(self.groups)), cum_weights=self._cum_weights)[0]

    def _message(self) -> Segment:
        return (_seed(self._rng), draw(self._rng, self.workload.prompt_chars))

    def _shared_or_plain(self, index: int, at_s: float, origin: str, traffic_class: str,
                         max_tokens: int, budget_ms: float | None) -> TraceRequest:
        rng = self._rng
        message = self._message()
        if rng.random() < self.workload.prefix_groups.share:
            group = self._group()
            return TraceRequest(index=index, at_s=at_s, origin=origin,
                                traffic_class=traffic_class, max_tokens=max_tokens,
                                user=(message,), system=self.groups[group],
                                prefix_group=group, ttft_budget_ms=budget_ms)
        return TraceRequest(index=index, at_s=at_s, origin=origin, traffic_class=traffic_class,
                            max_tokens=max_tokens, user=(message,), ttft_budget_ms=budget_ms)

    def _session_turn(self, index: int, at_s: float, origin: str,
                      max_tokens: int) -> TraceRequest:
        rng, spec = self._rng, self.workload.sessions
        open_sessions = self._sessions.setdefault(origin, [])
        message = self._message()
        session: _Session | None = None
        if open_sessions and rng.random() >= 1.0 / spec.mean_turns:
            session = rng.choice(open_sessions)
            if session.chars + message[1] + 1 > spec.max_prompt_chars:
                open_sessions.remove(session)  # its history is full: it ends here
                session = None
        if session is None:
            number = next(self._session_numbers)
            preamble = self._preamble()
            turns = 1  # geometric, mean `mean_turns`
            while turns < 50 and rng.random() >= 1.0 / spec.mean_turns:
                turns += 1
            session = _Session(f"{origin}-s{number}", preamble, turns)
            open_sessions.append(session)
            room = spec.max_prompt_chars - preamble[1] - 1
            message = (message[0], max(1, min(message[1], room)))
        session.messages.append(message)
        if len(session.messages) >= session.planned_turns:
            open_sessions.remove(session)
        return TraceRequest(index=index, at_s=at_s, origin=origin, traffic_class="interactive",
                            max_tokens=max_tokens, user=tuple(session.messages),
                            system=session.preamble, session_id=session.session_id,
                            turn=len(session.messages))


def _poisson(rng: random.Random, rate_per_s: float, start_s: float, end_s: float
             ) -> list[float]:
    times: list[float] = []
    if rate_per_s <= 0:
        return times
    t = start_s + rng.expovariate(rate_per_s)
    while t < end_s:
        times.append(t)
        t += rng.expovariate(rate_per_s)
    return times


def arrivals(scenario: Scenario, region_capacity_rps: dict[str, float], seed: int
             ) -> tuple[list[tuple[float, str]], list[dict[str, object]]]:
    """(time, origin) of every request in time order, and the bursts drawn."""
    duration = scenario.duration_s
    timed: list[tuple[float, str]] = []
    for origin, steps in scenario.demand.items():
        rng = random.Random(f"{seed}:arrivals:{origin}")
        capacity = region_capacity_rps[origin]
        bounds = [step.at * duration for step in steps] + [duration]
        for step, start, end in zip(steps, bounds, bounds[1:], strict=False):
            timed += [(t, origin) for t in _poisson(rng, step.load * capacity, start, end)]
    bursts: list[dict[str, object]] = []
    rng = random.Random(f"{seed}:bursts")
    spec = scenario.bursts
    origins = sorted(scenario.demand)
    for number in range(spec.count):
        origin = rng.choice(origins)
        start = rng.uniform(0.0, max(0.0, duration - spec.duration_s))
        end = min(duration, start + spec.duration_s)
        burst_rng = random.Random(f"{seed}:burst:{number}")
        rate = spec.load * region_capacity_rps[origin]
        timed += [(t, origin) for t in _poisson(burst_rng, rate, start, end)]
        bursts.append({"origin": origin, "start_s": round(start, 3), "end_s": round(end, 3),
                       "rate_per_s": round(rate, 3)})
    timed += synchronized_bursts(scenario)
    timed.sort()
    return timed[:scenario.max_requests], bursts


def synchronized_bursts(scenario: Scenario) -> list[tuple[float, str]]:
    """`sync_bursts.requests` arrivals per origin region at exactly each burst moment:
    every router replica's clients send at the same instant (the replayer sends requests
    due at the same time back to back, without sleeping between them)."""
    origins = sorted(scenario.demand) or sorted(scenario.regions)
    return [(at_s, origin) for at_s in sync_moments(scenario)
            for origin in origins for _ in range(scenario.sync_bursts.requests)]


def sync_moments(scenario: Scenario) -> list[float]:
    """The instants (s, as the trace writes them) of the synchronized bursts."""
    return [round(at * scenario.duration_s, 4) for at in scenario.sync_bursts.at]


def calibration_sample(scenario: Scenario, seed: int) -> list[TraceRequest]:
    """Requests drawn from the scenario's content mix (not the trace's own) to measure
    capacity with."""
    source = ContentSource(scenario.workload, seed + 1_000_003)
    origins = sorted(scenario.demand) or sorted(scenario.regions)
    return [source.next(i, 0.0, origins[i % len(origins)]) for i in range(CALIBRATION_REQUESTS)]


def worker_capacities(scenario: Scenario, seed: int) -> dict[str, float]:
    """Per region, the requests per second one of its workers serves at saturation
    (measured once per distinct engine speed)."""
    sample = calibration_sample(scenario, seed)
    by_speed: dict[float, float] = {}
    found: dict[str, float] = {}
    for region, spec in scenario.regions.items():
        if spec.speed not in by_speed:
            by_speed[spec.speed] = worker_capacity_rps(scenario.engine_for(region), sample,
                                                       scenario.model)
        found[region] = by_speed[spec.speed]
    return found


def generate(scenario: Scenario, *, seed: int | None = None, quick: bool = False) -> Trace:
    """The scenario's trace (its `--quick` variant when `quick`)."""
    seed = scenario.seed if seed is None else seed
    shaped = scenario.quick_variant() if quick else scenario
    per_worker = worker_capacities(shaped, seed)
    capacity = {region: per_worker[region] * spec.workers
                for region, spec in shaped.regions.items()}
    timed, bursts = arrivals(shaped, capacity, seed)
    source = ContentSource(shaped.workload, seed)
    requests = tuple(source.next(index, round(at_s, 4), origin)
                     for index, (at_s, origin) in enumerate(timed))
    total_capacity = sum(capacity.values())
    header: dict[str, object] = {
        "scenario": shaped.name, "quick": quick, "seed": seed,
        "duration_s": shaped.duration_s, "model": shaped.model,
        # The fleet's mean per worker; each region's own (its engine speed) below.
        "worker_capacity_rps": round(sum(capacity.values()) / sum(
            spec.workers for spec in shaped.regions.values()), 3),
        "region_worker_capacity_rps": {r: round(c, 3) for r, c in per_worker.items()},
        "region_capacity_rps": {r: round(c, 3) for r, c in capacity.items()},
        "requests": len(requests),
        "offered_rps": round(len(requests) / shaped.duration_s, 3),
        "offered_share_of_capacity": round(len(requests) / shaped.duration_s
                                           / total_capacity, 3),
        "bursts": bursts,
    }
    return Trace(header=header, requests=requests)
