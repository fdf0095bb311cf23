"""The immutable view of the fleet that the request path reads without awaiting anything."""

from __future__ import annotations

import operator
from collections.abc import Generator, Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TypeVar

from worker.load_records import RecordItems, static_digest
from worker.schema import MAX_LATENCY_MS, Heartbeat, LifecycleState

# A model no worker serves any more is remembered this long after its last worker left
# (a request for it then gets 503 and Retry-After, not 404: a crashed engine is restarted
# and loads its model within minutes), and at most this many such models, the most
# recently served kept (heartbeats can name any number of models).
MODEL_MEMORY_S = 600.0
MODEL_MEMORY_MAX = 1_000
# Used until a worker has reported its own figures (no traffic yet).
DEFAULT_PREFILL_TOKENS_PER_S = 4000.0
DEFAULT_SERVICE_MS = 2000.0
# Above this KV usage new sequences start to wait for blocks even with free batch slots.
KV_PRESSURE_START = 0.9
# A prefill rate below this (tokens/s) is read as this: 1,000 s a token. The schema lets
# any rate in 0..MAX_TOKENS_PER_S through, and 1000 / 5e-324 is inf (then 0 tokens x inf
# is NaN, and a NaN score is never among the best: the pick found no candidate).
MIN_PREFILL_TOKENS_PER_S = 1e-3


def fresh_for_s(ttl_s: float, next_read_s: float) -> float:
    """How long a worker stays fresh after the router last heard of it: its TTL, or, when
    the router reads the load records only every so often, until the next read could take
    the worker's next record (`next_read_s`: the longest until then, ~3 s for 10,000
    workers; router.registry.collector). A live agent writes a record at least every half
    TTL (worker.cli checks), so reads that far apart always find a newer one: a live
    worker must not go stale between two of them."""
    return max(ttl_s, next_read_s)


class WorkerView:
    """One worker as this router last heard of it. Never changed once made: a new
    heartbeat or load record makes a new view (`with_load`).

    `heartbeat` is the last full heartbeat: the worker's identity, state, models and
    capacity. Its order (`seq`, `sent_at_s`) and load figures are the view's own
    attributes, from that heartbeat or from a newer load record (worker.schema.
    load_record) taken with it. `received_at_s` is the router's monotonic clock when the
    latest of those arrived; the worker counts as fresh until `received_at_s +
    heartbeat.ttl_s`, or until the router's next read of the load records could take its
    next one, when that is later (`fresh_for_s`). `inflight_at_receipt` is how many
    requests this router had open on the worker at that moment, so that the policy can add
    what changed since (see router.registry.inflight).

    A plain class with slots rather than a frozen dataclass: a router makes thousands of
    views a second at scale, and a frozen class's `object.__setattr__` per field costs
    6x plain assignment.
    """

    __slots__ = (  # noqa: RUF023 (grouped by what they are, as documented)
        "heartbeat", "received_at_s", "inflight_at_receipt",
        # Read off the heartbeat once, as plain attributes: a routing decision reads them
        # for every candidate.
        "worker_id", "region", "endpoint", "ready", "ttl_s", "_digest",
        "served",  # the models and LoRA adapters it serves
        "seq", "sent_at_s", "running", "waiting", "kv_cache_usage", "ttft_ms", "itl_ms",
        "e2e_ms", "prefill_tokens_per_s", "decode_tokens_per_s",
        "expires_at_s",  # fresh while the router's clock is below it
        # Scoring terms, so that a routing decision is a few multiplications per candidate
        # (see router.policy.predicted_ttft, which documents what they mean).
        "reported_load", "slots", "queue_base", "queue_ms_per_request", "kv_pressure_ms",
        "prefill_ms_per_token",
        "utilisation",  # reported load per batch slot: what a region's ranking sorts by
    )

    heartbeat: Heartbeat
    received_at_s: float
    inflight_at_receipt: int
    worker_id: str
    region: str
    endpoint: str
    ready: bool
    ttl_s: float
    _digest: int | None
    served: tuple[str, ...]
    seq: int
    sent_at_s: float
    running: int
    waiting: int
    kv_cache_usage: float | None
    ttft_ms: float | None
    itl_ms: float | None
    e2e_ms: float | None
    prefill_tokens_per_s: float | None
    decode_tokens_per_s: float | None
    expires_at_s: float
    reported_load: int
    slots: int
    queue_base: int
    queue_ms_per_request: float
    kv_pressure_ms: float
    prefill_ms_per_token: float
    utilisation: float

    def __init__(self, heartbeat: Heartbeat | None, received_at_s: float,
                 inflight_at_receipt: int = 0, next_read_s: float = 0.0) -> None:
        """The view of `heartbeat`; None makes a blank that `_same_worker` fills (the
        compiled build refuses `object.__new__` on this class, and its `__new__` runs
        `__init__`)."""
        self.received_at_s = received_at_s
        self.inflight_at_receipt = inflight_at_receipt
        if heartbeat is None:
            return
        self.heartbeat = heartbeat
        self.worker_id = heartbeat.worker_id
        self.region = heartbeat.region
        self.endpoint = heartbeat.endpoint
        self.ready = heartbeat.state is LifecycleState.READY
        self.ttl_s = heartbeat.ttl_s
        self._digest = None
        self.served = (*heartbeat.models, *heartbeat.lora_adapters)
        self.seq = heartbeat.seq
        self.sent_at_s = heartbeat.sent_at_s
        load, performance = heartbeat.load, heartbeat.performance
        self.running = load.running
        self.waiting = load.waiting
        self.kv_cache_usage = load.kv_cache_usage
        self.ttft_ms = performance.ttft_ms
        self.itl_ms = performance.itl_ms
        self.e2e_ms = performance.e2e_ms
        self.prefill_tokens_per_s = performance.prefill_tokens_per_s
        self.decode_tokens_per_s = performance.decode_tokens_per_s
        self.slots = heartbeat.capacity.max_num_seqs
        self._derive(next_read_s)

    def _derive(self, next_read_s: float) -> None:
        """The scoring terms. Finite whatever the figures (the schema's limits keep them
        so; the comparisons here keep them so even for a view of a heartbeat that skipped
        validation): a NaN or infinite term would make every score NaN or inf."""
        slots = self.slots
        service_ms = self.e2e_ms
        if service_ms is None or not 0.0 < service_ms <= MAX_LATENCY_MS:  # NaN too
            service_ms = DEFAULT_SERVICE_MS
        kv_usage = self.kv_cache_usage
        pressure = 0.0
        if kv_usage is not None and kv_usage > KV_PRESSURE_START:
            pressure = min(1.0, (kv_usage - KV_PRESSURE_START) / (1.0 - KV_PRESSURE_START))
        rate = self.prefill_tokens_per_s
        if rate is None or not rate > 0.0:  # not measured yet (or NaN)
            rate = DEFAULT_PREFILL_TOKENS_PER_S
        elif rate < MIN_PREFILL_TOKENS_PER_S:
            rate = MIN_PREFILL_TOKENS_PER_S
        self.expires_at_s = self.received_at_s + fresh_for_s(self.ttl_s, next_read_s)
        self.reported_load = load = self.running + self.waiting
        # Requests ahead of a new one that wait for a batch slot, less this router's open
        # requests on the worker when the heartbeat came (add those open now).
        self.queue_base = load - self.inflight_at_receipt + 1 - slots
        self.utilisation = load / slots
        self.queue_ms_per_request = service_ms / slots
        self.kv_pressure_ms = pressure * service_ms
        self.prefill_ms_per_token = 1000.0 / rate

    def _same_worker(self, received_at_s: float, inflight_at_receipt: int) -> WorkerView:
        """A new view of this worker with what its heartbeat says of it (identity, models,
        capacity), received at `received_at_s`; the caller sets the rest."""
        view = WorkerView(None, received_at_s, inflight_at_receipt)
        view.heartbeat = self.heartbeat
        view.worker_id = self.worker_id
        view.region = self.region
        view.endpoint = self.endpoint
        view.ready = self.ready
        view.ttl_s = self.ttl_s
        view._digest = self._digest
        view.served = self.served
        view.slots = self.slots
        return view

    def with_load(self, record: RecordItems, received_at_s: float,
                  inflight_at_receipt: int, next_read_s: float = 0.0) -> WorkerView:
        """This worker as a newer load record of the same heartbeat describes it
        (`record`: its items, as worker.schema.record_items returns them), read at
        `received_at_s`; `next_read_s`: see `fresh_for_s`."""
        view = self._same_worker(received_at_s, inflight_at_receipt)
        (_, _, view.seq, view.sent_at_s, _, view.running, view.waiting, view.kv_cache_usage,
         view.ttft_ms, view.itl_ms, view.e2e_ms, view.prefill_tokens_per_s,
         view.decode_tokens_per_s, *_) = record
        view._derive(next_read_s)
        return view

    def received_again(self, received_at_s: float, next_read_s: float = 0.0) -> WorkerView:
        """The same report, as if received at `received_at_s` (see the collector)."""
        view = self._same_worker(received_at_s, self.inflight_at_receipt)
        view.seq = self.seq
        view.sent_at_s = self.sent_at_s
        view.running = self.running
        view.waiting = self.waiting
        view.kv_cache_usage = self.kv_cache_usage
        view.ttft_ms = self.ttft_ms
        view.itl_ms = self.itl_ms
        view.e2e_ms = self.e2e_ms
        view.prefill_tokens_per_s = self.prefill_tokens_per_s
        view.decode_tokens_per_s = self.decode_tokens_per_s
        view.expires_at_s = received_at_s + fresh_for_s(self.ttl_s, next_read_s)
        view.reported_load = self.reported_load
        view.queue_base = self.queue_base
        view.utilisation = self.utilisation
        view.queue_ms_per_request = self.queue_ms_per_request
        view.kv_pressure_ms = self.kv_pressure_ms
        view.prefill_ms_per_token = self.prefill_ms_per_token
        return view

    @property
    def static_digest(self) -> int:
        """worker.schema.static_digest of the heartbeat (computed once, when first asked)."""
        digest = self._digest
        if digest is None:
            digest = self._digest = static_digest(self.heartbeat)
        return digest

    def fresh(self, now_s: float) -> bool:
        return now_s < self.expires_at_s

    def newer_than(self, other: WorkerView) -> bool:
        """Whether this report supersedes `other` (same worker): later send time, then seq."""
        return (self.sent_at_s, self.seq) > (other.sent_at_s, other.seq)

    def __repr__(self) -> str:
        return (f"WorkerView({self.worker_id!r}, {self.region!r}, seq={self.seq}, "
                f"load={self.running}+{self.waiting}/{self.slots}, "
                f"received_at_s={self.received_at_s:.3f})")



# Models with at least this many workers get a per-region ranking (see Snapshot.ranked).
RANK_ABOVE_WORKERS = 48
# About this many views are grouped or ranked between two pauses of
# Snapshot.build_in_steps (~1-2 ms).
VIEWS_PER_STEP = 1_000


T = TypeVar("T")


def finish(steps: Generator[None, None, T]) -> T:
    """Run a generator of steps (Snapshot.build_in_steps) to its end; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            result: T = done.value
            return result


_utilisation = operator.attrgetter("utilisation")
_prefill_ms_per_token = operator.attrgetter("prefill_ms_per_token")
_kv_pressure_ms = operator.attrgetter("kv_pressure_ms")
_second = operator.itemgetter(1)


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
                   views=tuple(sorted(views, key=_utilisation)),
                   min_prefill_ms_per_token=min(map(_prefill_ms_per_token, views)),
                   min_kv_pressure_ms=min(map(_kv_pressure_ms, views)))


ScoringRow = tuple[WorkerView, str, str, float, float, float, int, float]


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
    # model -> when a worker last served it (`built_at_s` of the last snapshot with one),
    # for models that no worker here serves: see `knows_model` and `remembering`.
    gone_models: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    # model -> `ready_terms(model)`, filled on first use (a snapshot's views never change)
    _terms: dict[str, tuple[ScoringRow, ...]] = field(default_factory=dict, init=False,
                                                      compare=False, repr=False)

    @classmethod
    def build(
        cls,
        views: Iterable[WorkerView],
        *,
        built_at_s: float,
        redis_connected: bool,
        last_redis_ok_at_s: float | None,
    ) -> Snapshot:
        return finish(cls.build_in_steps(views, built_at_s=built_at_s,
                                         redis_connected=redis_connected,
                                         last_redis_ok_at_s=last_redis_ok_at_s))

    @classmethod
    def build_in_steps(
        cls,
        views: Iterable[WorkerView],
        *,
        built_at_s: float,
        redis_connected: bool,
        last_redis_ok_at_s: float | None,
    ) -> Generator[None, None, Snapshot]:
        """`build` as a generator that pauses after about every VIEWS_PER_STEP views of
        work and returns the snapshot: the collector lets requests run between the steps
        (a fleet of 10,000 takes ~10-20 ms to build). `views` is read before the first
        pause."""
        workers = {view.worker_id: view for view in views}
        # Workers grouped by what they serve and where: a fleet has few such groups (one
        # per region and set of models), so most of the work below is per group, and a
        # region's ranking of a model is usually one group's, sorted once for all the
        # models the group serves.
        groups: dict[tuple[tuple[str, ...], str], list[WorkerView]] = {}
        for count, view in enumerate(workers.values(), start=1):
            key = (view.served, view.region)
            found = groups.get(key)
            if found is None:
                groups[key] = [view]
            else:
                found.append(view)
            if count % VIEWS_PER_STEP == 0:
                yield
        index: dict[str, list[WorkerView]] = {}
        in_region: dict[tuple[str, str], list[tuple[tuple[str, ...], str]]] = {}
        for key, members in groups.items():
            served, region = key
            for model in served:
                index.setdefault(model, []).extend(members)
                in_region.setdefault((model, region), []).append(key)
        yield
        rankings: dict[str, list[RegionRanking]] = {}
        of_group: dict[tuple[tuple[str, ...], str], RegionRanking] = {}
        ranked_views = 0
        for (model, _), keys in in_region.items():
            if len(index[model]) < RANK_ABOVE_WORKERS:
                continue
            if len(keys) == 1:
                ranking = of_group.get(keys[0])
                if ranking is None:
                    ranking = of_group[keys[0]] = RegionRanking.of(groups[keys[0]])
                    ranked_views += len(ranking.views)
            else:
                ranking = RegionRanking.of([view for key in keys for view in groups[key]])
                ranked_views += len(ranking.views)
            rankings.setdefault(model, []).append(ranking)
            if ranked_views >= VIEWS_PER_STEP:
                ranked_views = 0
                yield
        ranked = {model: tuple(found) for model, found in rankings.items()}
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

    def knows_model(self, model: str, now_s: float) -> bool:
        """Whether some worker serves `model`, or served it less than MODEL_MEMORY_S ago
        (its last worker died or left: it is likely to come back)."""
        if model in self.by_model:
            return True
        last_s = self.gone_models.get(model)
        return last_s is not None and now_s - last_s < MODEL_MEMORY_S

    def remembering(self, previous: Snapshot) -> Snapshot:
        """This snapshot, also remembering the models that `previous` knew and no worker
        here serves (see `gone_models`), within MODEL_MEMORY_S and MODEL_MEMORY_MAX.
        Itself when there is nothing to remember (the usual case: the same models)."""
        served = self.by_model
        gone = previous.gone_models
        lost = previous.by_model.keys() - served.keys()
        if not lost and not gone:
            return self
        since_s = self.built_at_s - MODEL_MEMORY_S
        if not lost and gone.keys().isdisjoint(served) and min(gone.values()) > since_s:
            kept: Mapping[str, float] = gone  # unchanged: no copy at every build
        else:
            remembered = {model: last_s for model, last_s in gone.items()
                          if last_s > since_s and model not in served}
            remembered.update(dict.fromkeys(lost, previous.built_at_s))
            if len(remembered) > MODEL_MEMORY_MAX:
                newest = sorted(remembered.items(), key=_second, reverse=True)
                remembered = dict(newest[:MODEL_MEMORY_MAX])
            kept = MappingProxyType(remembered)
        return replace(self, gone_models=kept)

    def ready_terms(self, model: str) -> tuple[ScoringRow, ...]:
        """The model's `ready` workers, each as (view, worker id, region, expires_at_s,
        kv_pressure_ms, prefill_ms_per_token, queue_base, queue_ms_per_request) (add this
        router's open requests on the worker to queue_base for the requests ahead of a new
        one: router.policy.predicted_ttft.predicted_ms). Built once per
        snapshot and model: a routing decision over a small pool reads one tuple per worker
        instead of eight attributes (see router.policy.predicted_ttft)."""
        rows = self._terms.get(model)
        if rows is None:
            if model not in self.by_model:
                return ()  # not kept: clients name any model they like
            rows = self._terms[model] = tuple(
                (view, view.worker_id, view.region, view.expires_at_s, view.kv_pressure_ms,
                 view.prefill_ms_per_token, view.queue_base, view.queue_ms_per_request)
                for view in self.by_model.get(model, ()) if view.ready)
        return rows

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
    """The one mutable cell: collectors replace `current`; the request path only reads it.

    A snapshot put in `current` is kept as it `remembering` the one it replaces: so the
    fleet view knows, for a while, the models whose last worker left (see
    Snapshot.knows_model), although a collector builds each snapshot from its live
    workers alone.
    """

    __slots__ = ("_current",)

    def __init__(self, initial: Snapshot | None = None) -> None:
        self._current = initial or Snapshot()

    @property
    def current(self) -> Snapshot:
        return self._current

    @current.setter
    def current(self, snapshot: Snapshot) -> None:
        self._current = snapshot.remembering(self._current)
