"""The immutable view of the fleet that the request path reads without awaiting anything:
a `Snapshot` of every worker's view (router.registry.worker_view), indexed by model and
ranked by region, and the `SnapshotHolder` that collectors replace it in."""

from __future__ import annotations

import operator
from collections.abc import Generator, Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TypeVar

from router.registry.worker_view import WorkerView
from worker.schema import LifecycleState

# A model no worker serves any more is remembered this long after its last worker left
# (a request for it then gets 503 and Retry-After, not 404: a crashed engine is restarted
# and loads its model within minutes), and at most this many such models, the most
# recently served kept (heartbeats can name any number of models).
MODEL_MEMORY_S = 600.0
MODEL_MEMORY_MAX = 1_000
# Models with at least this many workers get a per-region ranking (see Snapshot.ranked).
RANK_ABOVE_WORKERS = 48
# About this many views are grouped or ranked between two pauses of
# Snapshot.build_in_steps (~1-2 ms).
VIEWS_PER_STEP = 1_000
# A context length above any a heartbeat can give (worker.schema.MAX_CONTEXT_TOKENS):
# what a worker that gives none is taken to have.
UNBOUNDED_CONTEXT = 1 << 62


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
_engine_ms = operator.attrgetter("engine_ms")
_second = operator.itemgetter(1)


@dataclass(frozen=True, slots=True)
class RegionRanking:
    """One region's workers of one model, least loaded per batch slot first, with the
    lowest scoring terms among them: a floor under any of their predicted TTFTs, so a
    decision can skip a region that cannot win without looking at its workers."""

    region: str
    views: tuple[WorkerView, ...]
    min_prefill_ms_per_token: float
    min_engine_ms: float

    @classmethod
    def of(cls, views: list[WorkerView]) -> RegionRanking:
        return cls(region=views[0].region,
                   views=tuple(sorted(views, key=_utilisation)),
                   min_prefill_ms_per_token=min(map(_prefill_ms_per_token, views)),
                   min_engine_ms=min(map(_engine_ms, views)))


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
    # model -> `contexts(model)`, filled on first use (read directly on the request path)
    context_bounds: dict[str, tuple[int, int]] = field(default_factory=dict, init=False,
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
        engine_ms, prefill_ms_per_token, queue_base, queue_ms_per_request) (add this
        router's open requests on the worker to queue_base for the requests ahead of a new
        one: router.policy.predicted_ttft.predicted_ms). Built once per
        snapshot and model: a routing decision over a small pool reads one tuple per worker
        instead of eight attributes (see router.policy.predicted_ttft)."""
        rows = self._terms.get(model)
        if rows is None:
            if model not in self.by_model:
                return ()  # not kept: clients name any model they like
            rows = self._terms[model] = tuple(
                (view, view.worker_id, view.region, view.expires_at_s, view.engine_ms,
                 view.prefill_ms_per_token, view.queue_base, view.queue_ms_per_request)
                for view in self.by_model.get(model, ()) if view.ready)
        return rows

    def contexts(self, model: str) -> tuple[int, int]:
        """(floor, ceiling) of the context lengths (`max_model_len`) of the workers that
        serve `model`: a request needing no more than the floor fits any of them (the
        usual case, and the only check it costs: router.policy.filters.fitting); none
        needing more than the ceiling fits one. A worker whose heartbeat gives no length
        could take anything: it raises the ceiling to UNBOUNDED_CONTEXT and leaves the
        floor alone. Built once per snapshot and model."""
        found = self.context_bounds.get(model)
        if found is None:
            views = self.by_model.get(model, ())
            lengths = [view.heartbeat.capacity.max_model_len for view in views]
            known = [length for length in lengths if length is not None]
            floor = min(known, default=UNBOUNDED_CONTEXT)
            ceiling = (UNBOUNDED_CONTEXT if len(known) < len(lengths)
                       else max(known, default=UNBOUNDED_CONTEXT))
            found = (floor, ceiling)
            if views:  # (not kept for names no worker serves: clients name any they like)
                self.context_bounds[model] = found
        return found

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
