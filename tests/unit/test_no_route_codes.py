"""Why no worker can take a request: one NoRoute code per cause, on literal snapshots,
through the real policies; the snapshot's memory of models whose workers left; and whether
a retry could find a worker (router.proxy.retries.could_retry)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.core.outcome import Attempt, RequestRecord
from router.health.breaker import BreakerPolicy
from router.health.tracker import Health
from router.policy import NoRoute, RouteRequest, create_policy
from router.proxy.retries import could_retry
from router.registry.drained import NOTHING_DRAINED, Drained
from router.registry.snapshot import (
    MODEL_MEMORY_MAX,
    MODEL_MEMORY_S,
    RANK_ABOVE_WORKERS,
    Snapshot,
    SnapshotHolder,
)
from router.registry.worker_view import WorkerView
from tests.unit.test_policy import FakeClock, make_policy, snapshot, view
from worker.schema import LifecycleState

EU_ONLY = frozenset({"eu-west"})
CODES = {"model_unavailable", "region_unavailable", "draining", "no_capacity"}


def no_route(snap: Snapshot, *, policy: str = "predicted_ttft", model: str = "m",
             drained: Drained = NOTHING_DRAINED, allowed: frozenset[str] | None = None,
             exclude: frozenset[str] = frozenset(), now_s: float = 100.0) -> NoRoute:
    request = RouteRequest(model=model, origin_region="us-east", prompt_tokens=10,
                           drained=drained, allowed_regions=allowed, exclude=exclude)
    with pytest.raises(NoRoute) as caught:
        make_policy(policy, clock=FakeClock(now_s)).pick(snap, request)
    return caught.value


def fleet(*, per_region: int = 1) -> Snapshot:
    return snapshot(*(view(f"{region[:2]}-{i}", region)
                      for region in ("us-east", "eu-west") for i in range(per_region)))


def test_an_unknown_model_is_not_known() -> None:
    exc = no_route(fleet(), model="nonesuch")
    assert (exc.code, exc.model_known) == ("model_unavailable", False)
    assert "'nonesuch'" in exc.reason


@pytest.mark.parametrize("policy", ["predicted_ttft", "round_robin", "least_load"])
def test_a_model_whose_workers_went_silent_is_known_and_unavailable(policy: str) -> None:
    # Still in the table, past their TTL (the collector drops them a little later).
    stale = snapshot(view("us-1", received_at_s=90.0), view("eu-1", "eu-west",
                                                             received_at_s=90.0))
    exc = no_route(stale, policy=policy)
    assert (exc.code, exc.model_known) == ("model_unavailable", True)


@pytest.mark.parametrize("per_region", [1, RANK_ABOVE_WORKERS])  # plain and ranked paths
def test_residency_with_the_allowed_region_drained_is_region_unavailable(
        per_region: int) -> None:
    exc = no_route(fleet(per_region=per_region), allowed=EU_ONLY,
                   drained=Drained(regions=frozenset({"eu-west"})))
    assert exc.code == "region_unavailable"
    assert "(eu-west)" in exc.reason and "us-east" not in exc.reason


def test_residency_with_the_allowed_region_dead_is_region_unavailable() -> None:
    snap = snapshot(view("us-1"), view("eu-1", "eu-west", received_at_s=90.0))
    assert no_route(snap, allowed=EU_ONLY).code == "region_unavailable"
    no_eu = snapshot(view("us-1"))  # the region's last worker has left the table
    assert no_route(no_eu, allowed=EU_ONLY).code == "region_unavailable"


@pytest.mark.parametrize("per_region", [1, RANK_ABOVE_WORKERS])
@pytest.mark.parametrize("allowed", [None, EU_ONLY])
def test_everything_drained_is_draining(per_region: int, allowed: frozenset[str] | None) -> None:
    everything = Drained(regions=frozenset({"us-east", "eu-west"}))
    exc = no_route(fleet(per_region=per_region), drained=everything, allowed=allowed)
    assert exc.code == "draining"


def test_workers_that_are_stopping_are_draining() -> None:
    snap = snapshot(view("us-1", state=LifecycleState.DRAINING),
                    view("eu-1", "eu-west", state=LifecycleState.DRAINING))
    assert no_route(snap).code == "draining"
    # One drained by an operator, the other stopping by itself: still nothing but drains.
    mixed = snapshot(view("us-1"), view("eu-1", "eu-west", state=LifecycleState.DRAINING))
    assert no_route(mixed, drained=Drained(workers=frozenset({"us-1"}))).code == "draining"


def test_live_workers_all_tried_or_starting_is_no_capacity() -> None:
    assert no_route(fleet(), exclude=frozenset({"us-0", "eu-0"})).code == "no_capacity"
    starting = snapshot(view("us-1", state=LifecycleState.STARTING))
    assert no_route(starting).code == "no_capacity"
    # Residency, with the allowed region's only worker tried already: not the residency's
    # doing (the proxy reports the failed attempt).
    assert no_route(fleet(), allowed=EU_ONLY, exclude=frozenset({"eu-0"})).code == "no_capacity"


def test_nearest_outside_its_region_says_so_without_naming_workers() -> None:
    exc = no_route(snapshot(view("eu-1", "eu-west")), policy="nearest")
    assert exc.code == "no_capacity" and "eu-1" not in exc.reason


STATES = list(LifecycleState)
REGIONS = ("us-east", "eu-west", "ap-south")


@settings(max_examples=300, deadline=None)
@given(
    workers=st.lists(st.tuples(st.sampled_from(REGIONS), st.sampled_from(STATES),
                               st.booleans()), max_size=8),
    drained_regions=st.frozensets(st.sampled_from(REGIONS)),
    allowed=st.none() | st.frozensets(st.sampled_from(REGIONS), min_size=1),
    excluded=st.frozensets(st.integers(0, 7)),
    policy=st.sampled_from(["predicted_ttft", "power_of_two", "random"]),
)
def test_every_no_route_names_its_cause_and_nothing_internal(
        workers: list[tuple[str, LifecycleState, bool]], drained_regions: frozenset[str],
        allowed: frozenset[str] | None, excluded: frozenset[int], policy: str) -> None:
    views = [view(f"w{i}-secret", region, state=state,
                  received_at_s=100.0 if fresh else 90.0)
             for i, (region, state, fresh) in enumerate(workers)]
    drained = Drained(regions=drained_regions)
    exclude = frozenset(f"w{i}-secret" for i in excluded)
    request = RouteRequest(model="m", origin_region="us-east", drained=drained,
                           allowed_regions=allowed, exclude=exclude)
    try:
        make_policy(policy).pick(snapshot(*views), request)
    except NoRoute as exc:
        assert exc.code in CODES
        assert "secret" not in exc.reason and "127.0.0.1" not in exc.reason
        live = [v for v in views if v.fresh(100.0)]
        takers = [v for v in live if v.heartbeat.state in (LifecycleState.READY,
                                                           LifecycleState.DEGRADED)
                  and v.region not in drained_regions]
        inside = [v for v in takers if allowed is None or v.region in allowed]
        if exc.code == "model_unavailable":
            assert not live and exc.model_known == bool(views)
        elif exc.code == "draining":
            assert not takers and any(v.region in drained_regions
                                      or v.heartbeat.state is LifecycleState.DRAINING
                                      for v in live)
        elif exc.code == "region_unavailable":
            assert allowed is not None and takers and not inside
            assert f"({', '.join(sorted(allowed))})" in exc.reason
        else:  # no_capacity: the allowed workers that could take it were all tried
            assert all(v.worker_id in exclude for v in inside)
            assert inside or not takers


def served_by(*models: str, built_at_s: float, worker: str = "w1") -> Snapshot:
    views = [view(worker, models=models)] if models else []
    return Snapshot.build(views, built_at_s=built_at_s, redis_connected=True,
                          last_redis_ok_at_s=built_at_s)


def test_the_holder_remembers_a_model_whose_last_worker_left() -> None:
    holder = SnapshotHolder()
    holder.current = served_by("m", "lora-a", built_at_s=100.0)
    holder.current = served_by(built_at_s=103.0)  # its worker died and left the table
    snap = holder.current
    assert not snap.serving("m")
    assert snap.knows_model("m", 103.0) and snap.knows_model("lora-a", 103.0)
    assert snap.knows_model("m", 100.0 + MODEL_MEMORY_S - 1)
    assert not snap.knows_model("m", 100.0 + MODEL_MEMORY_S + 1)
    assert not snap.knows_model("never-served", 103.0)
    # Carried through later snapshots, forgotten once older than MODEL_MEMORY_S.
    holder.current = served_by("n", built_at_s=200.0, worker="w2")
    assert holder.current.knows_model("m", 200.0)
    holder.current = served_by("n", built_at_s=100.0 + MODEL_MEMORY_S + 1, worker="w2")
    assert "m" not in holder.current.gone_models
    # A model served again is no longer "gone".
    holder.current = served_by("m", built_at_s=800.0)
    assert "n" in holder.current.gone_models and "m" not in holder.current.gone_models


def test_the_holder_keeps_the_snapshot_itself_when_nothing_left() -> None:
    holder = SnapshotHolder()
    first = served_by("m", built_at_s=1.0)
    holder.current = first
    same_models = served_by("m", built_at_s=2.0)
    holder.current = same_models
    assert holder.current is same_models


def test_the_memory_is_bounded_newest_first() -> None:
    holder = SnapshotHolder()
    extra = 50
    for i in range(MODEL_MEMORY_MAX + extra):
        # A tenth of a second apart: none is older than MODEL_MEMORY_S at the end.
        holder.current = served_by(f"model-{i}", built_at_s=i / 10, worker=f"w{i}")
    holder.current = served_by(built_at_s=(MODEL_MEMORY_MAX + extra) / 10)
    gone = holder.current.gone_models
    assert len(gone) == MODEL_MEMORY_MAX
    assert "model-0" not in gone and f"model-{MODEL_MEMORY_MAX + extra - 1}" in gone
    assert min(gone.values()) == extra / 10


def test_a_model_served_lately_is_known_to_the_policy() -> None:
    holder = SnapshotHolder()
    holder.current = served_by("m", built_at_s=100.0)
    holder.current = served_by("other", built_at_s=101.0, worker="w2")
    exc = no_route(holder.current, now_s=102.0)
    assert (exc.code, exc.model_known) == ("model_unavailable", True)
    later = no_route(holder.current, now_s=101.0 + MODEL_MEMORY_S)
    assert later.model_known is False


def test_views_keep_their_identity_in_remembered_snapshots() -> None:
    holder = SnapshotHolder()
    holder.current = served_by("m", built_at_s=1.0)
    now = served_by("n", built_at_s=2.0, worker="w2")
    holder.current = now
    assert holder.current is not now  # a copy that remembers "m"
    kept: WorkerView = holder.current.workers["w2"]
    assert kept is now.workers["w2"] and holder.current.by_model is now.by_model


def test_a_retry_could_go_only_to_a_worker_untried_and_not_ejected() -> None:
    # Passive health asks this before it abandons an attempt on a stalled worker
    # (Attempt.elsewhere): a retry that would find no worker, or only an ejected one
    # (which the health filter offers when it has nothing else), is no better than waiting.
    clock = FakeClock(100.0)
    health = Health(BreakerPolicy(), clock=clock)
    policy = create_policy("predicted_ttft",
                           dataclasses.replace(make_policy(clock=clock).context, health=health))
    holder = SnapshotHolder(fleet())
    route = RouteRequest(model="m", origin_region="us-east", prompt_tokens=10)
    record = RequestRecord(model="m", kind="chat", stream=False, origin_region="us-east",
                           received_s=100.0)
    record.attempts.append(Attempt(worker_id="us-0", region="us-east", predicted_ttft_ms=5.0,
                                   reason="local", started_s=100.0))
    assert could_retry(policy, holder, route, record)  # eu-0: untried, admitted
    health.reported_down("eu-0", "eu-west", "degraded")  # ejected
    assert not could_retry(policy, holder, route, record)
    assert could_retry(policy, holder, route._replace(exclude=frozenset()),
                       RequestRecord(model="m", kind="chat", stream=False,
                                     origin_region="us-east", received_s=100.0))
    clock.now = 200.0  # eu-0's backoff has run out: half-open, its next request the probe
    assert could_retry(policy, holder, route, record)
    record.attempts.append(Attempt(worker_id="eu-0", region="eu-west", predicted_ttft_ms=5.0,
                                   reason="retry", started_s=200.0))
    assert not could_retry(policy, holder, route, record)  # both tried
