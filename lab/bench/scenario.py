"""A benchmark scenario: the test bed (regions, RTTs, simulated engines) and the workload.

Scenarios are YAML files; the standard ones ship in `lab/bench/scenarios/` and are
named without `.yaml` (`--scenario skewed-3region`); any other path works too. Demand is
given per origin region as a multiple of that region's own capacity, so that "80 % of the
fleet" means the same thing whatever the engine settings: the capacity comes from the
simulator's own engine model (lab.bench.capacity), per region at that region's engine
`speed`. Beyond demand and random bursts, a scenario may send synchronized bursts (the
same instant at every origin) and run CPU hogs beside the routers (`host_noise`). Errors
name the file and the path in the document, as regions.yaml errors do:

    skewed.yaml: demand.us-east.1.load: must be >= 0
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

SCENARIO_DIR = Path(__file__).with_name("scenarios")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BoundedLognormal(_Strict):
    """A skewed length: lognormal with this median and shape, clipped to [min, max]."""

    median: float = Field(gt=0)
    sigma: float = Field(ge=0, le=3)
    min: int = Field(ge=1)
    max: int = Field(ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> BoundedLognormal:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must be <= max ({self.max})")
        return self

    @property
    def mu(self) -> float:
        return math.log(self.median)


class EngineSpec(_Strict):
    """Every simulated worker's engine (the `globalpool sim` flags of the same names)."""

    max_num_seqs: int = Field(default=8, ge=1, le=256)
    kv_blocks: int = Field(default=1024, ge=16)
    block_size: int = Field(default=16, ge=1)
    prefill_tokens_per_s: float = Field(default=10_000.0, gt=0)
    decode_step_ms: float = Field(default=80.0, gt=0)
    decode_step_ms_per_seq: float = Field(default=2.0, ge=0)
    max_model_len: int = Field(default=4096, ge=16, description=(
        "context length in tokens (the sim's --max-model-len); at most kv_blocks x "
        "block_size, as vLLM requires"))

    @model_validator(mode="after")
    def _fits(self) -> EngineSpec:
        if self.max_model_len > self.kv_blocks * self.block_size:
            raise ValueError(f"max_model_len: {self.max_model_len} tokens do not fit in the "
                             f"KV cache ({self.kv_blocks} blocks x {self.block_size} tokens)")
        return self

    def at_speed(self, speed: float) -> EngineSpec:
        """This engine `speed` times as fast: prefill `speed` x the tokens per second, both
        decode step terms divided by `speed` (a faster or slower GPU, same capacity)."""
        if speed == 1.0:
            return self
        return self.model_copy(update={
            "prefill_tokens_per_s": self.prefill_tokens_per_s * speed,
            "decode_step_ms": self.decode_step_ms / speed,
            "decode_step_ms_per_seq": self.decode_step_ms_per_seq / speed})


class RegionSpec(_Strict):
    workers: int = Field(default=2, ge=1, le=8)
    cost_per_gpu_hour: float = Field(default=1.0, ge=0)
    rtt_ms: dict[str, float] = Field(
        default_factory=dict, description="RTT to other regions (one direction is enough)")
    speed: float = Field(default=1.0, gt=0, le=10, description=(
        "this region's engines run this many times as fast as `engine` says (prefill "
        "rate x speed, decode step times / speed): heterogeneous GPUs"))


class DemandStep(_Strict):
    """From `at` (a fraction of the run) until the next step, this multiple of capacity."""

    at: float = Field(ge=0, lt=1)
    load: float = Field(ge=0, le=10)


class Bursts(_Strict):
    """`count` bursts of `load` x the origin's capacity on top of its demand, each lasting
    `duration_s`, at seeded random times and origins."""

    count: int = Field(default=0, ge=0, le=100)
    duration_s: float = Field(default=2.0, gt=0)
    load: float = Field(default=0.8, ge=0, le=10)


class SyncBursts(_Strict):
    """At each of `at` (fractions of the run), every origin region with clients (each
    router replica's) sends `requests` requests at the same instant: replicas that all
    decide from the same snapshot at once, the herd a shared view invites."""

    at: list[float] = Field(default_factory=list, max_length=100)
    requests: int = Field(default=8, ge=1, le=200)

    @model_validator(mode="after")
    def _within_the_run(self) -> SyncBursts:
        if any(not 0 <= at < 1 for at in self.at):
            raise ValueError("at: every moment is a fraction of the run, in [0, 1)")
        return self


class HostNoise(_Strict):
    """CPU hogs beside the routers while each policy is measured (lab.bench.noise):
    `processes` children, each busy `duty` of every `period_ms` on one core."""

    processes: int = Field(default=1, ge=0, le=4)
    duty: float = Field(default=0.7, ge=0, le=1)
    period_ms: float = Field(default=50.0, ge=5, le=1000)


class PrefixGroups(_Strict):
    """Shared long prefixes (a system prompt, a document): `share` of the requests that are
    not session turns start with one of `count` texts, picked with a Zipf(`zipf_s`) law."""

    count: int = Field(default=40, ge=1, le=10_000)
    share: float = Field(default=0.45, ge=0, le=1)
    zipf_s: float = Field(default=1.0, ge=0)
    chars: BoundedLognormal = BoundedLognormal(median=1800, sigma=0.3, min=1100, max=3200)


class Sessions(_Strict):
    """`share` of interactive requests are turns of a conversation: a session's first
    turn is its preamble (`PrefixGroups.chars` long) plus a message; each later turn
    resends everything so far plus one more message. A session ends after
    `1 / mean_turns` odds per turn or when its prompt would pass `max_prompt_chars`."""

    share: float = Field(default=0.3, ge=0, le=1)
    mean_turns: float = Field(default=4.0, ge=1)
    max_prompt_chars: int = Field(default=4800, ge=1100)
    shared_preambles: bool = Field(default=False, description=(
        "a session's preamble is one of the prefix groups' texts (a shared system prompt, "
        "picked by the same Zipf law) instead of a text of its own"))


class Workload(_Strict):
    batch_share: float = Field(default=0.2, ge=0, le=1)
    batch_ttft_budget_ms: float | None = Field(
        default=4000.0, gt=0, description="sent as x-globalpool-ttft-budget-ms on batch")
    prompt_chars: BoundedLognormal = BoundedLognormal(median=500, sigma=0.8, min=40, max=3000)
    output_tokens: BoundedLognormal = BoundedLognormal(median=10, sigma=0.6, min=3, max=40)
    batch_output_tokens: BoundedLognormal = BoundedLognormal(
        median=24, sigma=0.5, min=8, max=96)
    prefix_groups: PrefixGroups = PrefixGroups()
    sessions: Sessions = Sessions()


class QuickOverrides(_Strict):
    """What `--quick` changes: a shorter run (the same shape, compressed)."""

    duration_s: float = Field(default=20.0, gt=0, le=600)
    bursts: Bursts | None = None
    sync_bursts: SyncBursts | None = None
    request_timeout_s: float | None = Field(default=None, gt=0)


class Scenario(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    description: str = ""
    seed: int = 1
    duration_s: float = Field(gt=0, le=3600)
    request_timeout_s: float = Field(default=60.0, gt=0, le=600)
    max_requests: int = Field(default=20_000, ge=1, le=200_000)
    model: str = "tiny-llama"
    interactive_ttft_slo_ms: float = Field(gt=0)
    heartbeat_interval_s: float = Field(default=0.5, gt=0, le=10)
    engine: EngineSpec = EngineSpec()
    regions: dict[str, RegionSpec] = Field(min_length=1)
    demand: dict[str, list[DemandStep]]
    bursts: Bursts = Bursts()
    sync_bursts: SyncBursts = SyncBursts()
    host_noise: HostNoise = HostNoise(processes=0)
    workload: Workload = Workload()
    quick: QuickOverrides = QuickOverrides()

    @model_validator(mode="after")
    def _consistent(self) -> Scenario:
        problems: list[str] = []
        for region, spec in self.regions.items():
            for other, rtt in spec.rtt_ms.items():
                if other not in self.regions:
                    problems.append(f"regions.{region}.rtt_ms.{other}: no region named {other!r}")
                elif rtt < 0:
                    problems.append(f"regions.{region}.rtt_ms.{other}: must be >= 0")
        for region, steps in self.demand.items():
            if region not in self.regions:
                problems.append(f"demand.{region}: no region named {region!r}")
            if not steps or steps[0].at != 0:
                problems.append(f"demand.{region}: the first step must be at 0")
            if any(b.at <= a.at for a, b in itertools.pairwise(steps)):
                problems.append(f"demand.{region}: steps must be in increasing `at` order")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def rtt_ms(self, src: str, dst: str) -> float:
        """RTT between two regions, either direction given; 0 within a region if unset."""
        there = self.regions[src].rtt_ms.get(dst)
        if there is not None:
            return there
        back = self.regions[dst].rtt_ms.get(src)
        if back is not None:
            return back
        if src == dst:
            return 0.0
        raise ValueError(f"no RTT between {src} and {dst}")

    def engine_for(self, region: str) -> EngineSpec:
        """The engine of `region`'s workers: `engine` at the region's speed."""
        return self.engine.at_speed(self.regions[region].speed)

    def load_at(self, region: str, fraction: float) -> float:
        """The origin's demand (x its capacity) at `fraction` of the run, bursts excluded."""
        load = 0.0
        for step in self.demand.get(region, []):
            if step.at <= fraction:
                load = step.load
        return load

    def quick_variant(self) -> Scenario:
        """The same scenario, shortened for CI (`--quick`)."""
        changes: dict[str, Any] = {"duration_s": self.quick.duration_s}
        if self.quick.bursts is not None:
            changes["bursts"] = self.quick.bursts
        if self.quick.sync_bursts is not None:
            changes["sync_bursts"] = self.quick.sync_bursts
        if self.quick.request_timeout_s is not None:
            changes["request_timeout_s"] = self.quick.request_timeout_s
        return self.model_copy(update=changes)


class ScenarioError(Exception):
    """A scenario file that cannot be used; `problems` name the path in the document."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = [f"{source}: {problem}" for problem in problems]
        super().__init__("\n".join(self.problems))


def shipped_scenarios() -> list[str]:
    return sorted(path.stem for path in SCENARIO_DIR.glob("*.yaml"))


def resolve(name_or_path: str) -> Path:
    """A shipped scenario's file by name, or the file at that path."""
    shipped = SCENARIO_DIR / f"{name_or_path}.yaml"
    if "/" not in name_or_path and shipped.is_file():
        return shipped
    path = Path(name_or_path)
    if path.is_file():
        return path
    known = ", ".join(shipped_scenarios())
    raise ScenarioError(name_or_path, [f"no such file, and no shipped scenario of that name "
                                       f"(shipped: {known})"])


def load_scenario(name_or_path: str) -> Scenario:
    """Read and validate a scenario. Raises ScenarioError listing every problem."""
    path = resolve(name_or_path)
    source = str(path)
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ScenarioError(source, [f"cannot read: {exc}"]) from None
    return parse_scenario(document, source)


def parse_scenario(document: Any, source: str = "scenario") -> Scenario:
    try:
        return Scenario.model_validate(document)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            path = ".".join(str(part) for part in error["loc"]) or "(document)"
            problems.append(f"{path}: {str(error['msg']).removeprefix('Value error, ')}")
        raise ScenarioError(source, problems) from None
