"""The immutable view of the fleet that the request path reads without awaiting anything."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from worker.schema import Heartbeat, LifecycleState

# Used until a worker has reported its own figures (no traffic yet).
DEFAULT_PREFILL_TOKENS_PER_S = 4000.0
DEFAULT_SERVICE_MS = 2000.0
# Above this KV usage new sequences start to wait for blocks even with free batch slots.
KV_PRESSURE_START = 0.9


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One worker as this router last heard of it.

    `received_at_s` is the router's monotonic clock when the heartbeat arrived; the
    worker counts as fresh until `received_at_s + heartbeat.ttl_s`. `inflight_at_receipt`
    is how many requests this router had open on the worker at that moment, so that the
    policy can add what changed since (see router.policy.inflight).
    """

    heartbeat: Heartbeat
    received_at_s: float
    inflight_at_receipt: int = 0
    # Read off the heartbeat once when it arrives, as plain attributes: a routing decision
    # reads them for every candidate.
    worker_id: str = field(init=False)
    region: str = field(init=False)
    endpoint: str = field(init=False)
    ready: bool = field(init=False)
    expires_at_s: float = field(init=False)  # fresh while the router's clock is below it
    # Scoring terms, so that a routing decision is a few multiplications per candidate
    # (see router.policy.predicted_ttft, which documents what they mean).
    reported_load: int = field(init=False)
    slots: int = field(init=False)
    queue_ms_per_request: float = field(init=False)
    kv_pressure_ms: float = field(init=False)
    prefill_ms_per_token: float = field(init=False)

    def __post_init__(self) -> None:
        heartbeat = self.heartbeat
        load = heartbeat.load
        slots = heartbeat.capacity.max_num_seqs
        service_ms = heartbeat.performance.e2e_ms or DEFAULT_SERVICE_MS
        kv_usage = load.kv_cache_usage
        pressure = 0.0
        if kv_usage is not None and kv_usage > KV_PRESSURE_START:
            pressure = (kv_usage - KV_PRESSURE_START) / (1.0 - KV_PRESSURE_START)
        rate = heartbeat.performance.prefill_tokens_per_s or DEFAULT_PREFILL_TOKENS_PER_S
        assign = object.__setattr__
        assign(self, "worker_id", heartbeat.worker_id)
        assign(self, "region", heartbeat.region)
        assign(self, "endpoint", heartbeat.endpoint)
        assign(self, "ready", heartbeat.state is LifecycleState.READY)
        assign(self, "expires_at_s", self.received_at_s + heartbeat.ttl_s)
        assign(self, "reported_load", load.running + load.waiting)
        assign(self, "slots", slots)
        assign(self, "queue_ms_per_request", service_ms / slots)
        assign(self, "kv_pressure_ms", pressure * service_ms)
        assign(self, "prefill_ms_per_token", 1000.0 / rate)

    def fresh(self, now_s: float) -> bool:
        return now_s < self.expires_at_s

    def newer_than(self, other: WorkerView) -> bool:
        """Whether this report supersedes `other` (same worker): later send time, then seq."""
        mine, theirs = self.heartbeat, other.heartbeat
        return (mine.sent_at_s, mine.seq) > (theirs.sent_at_s, theirs.seq)


# Models with at least this many workers get a per-region ranking (see Snapshot.ranked).
RANK_ABOVE_WORKERS = 48


def _reported_utilisation(view: WorkerView) -> float:
    load = view.heartbeat.load
    return (load.running + load.waiting) / view.heartbeat.capacity.max_num_seqs


@dataclass(frozen=True, slots=True)
class RegionRanking:
    """One region's workers of one model, least loaded per batch slot first, with the
    lowest scoring terms among them: a floor under any of their predicted TTFTs, so a
    decision can skip a region that cannot win without looking at its workers."""

    region: str
    views: tuple[WorkerView, ...]
    min_prefill_ms_per_token: float
    min_kv_pressure_ms: float

    @classmethod
    def of(cls, views: list[WorkerView]) -> RegionRanking:
        return cls(region=views[0].region,
                   views=tuple(sorted(views, key=_reported_utilisation)),
                   min_prefill_ms_per_token=min(v.prefill_ms_per_token for v in views),
                   min_kv_pressure_ms=min(v.kv_pressure_ms for v in views))


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Every known worker, indexed by model, plus how current the view is.

    `redis_connected` is False while the collector cannot reach Redis: the router then
    keeps serving from this (static) view and says so.
    """

    workers: Mapping[str, WorkerView] = field(default_factory=lambda: MappingProxyType({}))
    by_model: Mapping[str, tuple[WorkerView, ...]] = field(
        default_factory=lambda: MappingProxyType({})
    )
    # model -> one ranking per region (models with RANK_ABOVE_WORKERS workers or more):
    # lets a decision over thousands of workers look at the few least loaded of each
    # region, and skip regions that cannot win, instead of scoring all of them.
    ranked: Mapping[str, tuple[RegionRanking, ...]] = field(
        default_factory=lambda: MappingProxyType({})
    )
    built_at_s: float = 0.0
    redis_connected: bool = False
    last_redis_ok_at_s: float | None = None

    @classmethod
    def build(
        cls,
        views: Iterable[WorkerView],
        *,
        built_at_s: float,
        redis_connected: bool,
        last_redis_ok_at_s: float | None,
    ) -> Snapshot:
        workers = {view.worker_id: view for view in views}
        index: dict[str, list[WorkerView]] = {}
        for view in workers.values():
            for model in (*view.heartbeat.models, *view.heartbeat.lora_adapters):
                index.setdefault(model, []).append(view)
        ranked: dict[str, tuple[RegionRanking, ...]] = {}
        for model, model_views in index.items():
            if len(model_views) < RANK_ABOVE_WORKERS:
                continue
            regions: dict[str, list[WorkerView]] = {}
            for view in model_views:
                regions.setdefault(view.region, []).append(view)
            ranked[model] = tuple(RegionRanking.of(vs) for vs in regions.values())
        return cls(
            workers=MappingProxyType(workers),
            by_model=MappingProxyType({m: tuple(vs) for m, vs in index.items()}),
            ranked=MappingProxyType(ranked),
            built_at_s=built_at_s,
            redis_connected=redis_connected,
            last_redis_ok_at_s=last_redis_ok_at_s,
        )

    def serving(self, model: str) -> tuple[WorkerView, ...]:
        return self.by_model.get(model, ())

    def models(self, now_s: float) -> list[str]:
        """Models served by at least one fresh worker that is not draining or gone."""
        now_s = self.freshness_now(now_s)
        return sorted(
            model
            for model, views in self.by_model.items()
            if any(v.fresh(now_s) and v.heartbeat.state is not LifecycleState.DRAINING
                   for v in views)
        )

    def freshness_now(self, now_s: float) -> float:
        """The time to judge heartbeat freshness by: the last moment Redis delivered
        anything (a heartbeat or a full read), never later than `now_s`.

        While Redis is unreachable, or hangs, no heartbeat can arrive, so the clock for
        staleness stops: the router keeps routing to the workers it last knew (fail
        static) and relies on its own observations to avoid dead ones. While Redis
        answers, the other workers' heartbeats and the periodic full read keep it running.
        """
        if self.last_redis_ok_at_s is None:
            return now_s
        return min(now_s, self.last_redis_ok_at_s)

    def view_age_s(self, now_s: float) -> float | None:
        """Seconds since Redis last answered, or None if it never has."""
        if self.last_redis_ok_at_s is None:
            return None
        return max(0.0, now_s - self.last_redis_ok_at_s)


class SnapshotHolder:
    """The one mutable cell: collectors replace `current`; the request path only reads it."""

    __slots__ = ("current",)

    def __init__(self, initial: Snapshot | None = None) -> None:
        self.current = initial or Snapshot()
