"""Filters, scoring and the pick, on literal snapshots with an injected clock and random source."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from router.core.outcome import Attempt
from router.policy import NoRoute, Policy, RouteRequest, RoutingContext, create_policy
from router.policy.affinity import AffinityTable
from router.policy.base import two_of
from router.policy.predicted_ttft import predicted_ms
from router.registry.inflight import InFlight
from router.registry.snapshot import Snapshot
from router.registry.worker_view import WorkerView
from worker.schema import Capacity, Heartbeat, LifecycleState, Load, Performance

RTT = {("us-east", "us-east"): 1.0, ("us-east", "eu-west"): 80.0, ("eu-west", "eu-west"): 1.0}


def rtt_ms(a: str, b: str) -> float:
    return RTT.get((a, b), RTT.get((b, a), 1000.0))


class FakeClock:
    """An injected monotonic clock (a value, not a mock of our code)."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def view(
    worker_id: str,
    region: str = "us-east",
    *,
    running: int = 0,
    waiting: int = 0,
    slots: int = 8,
    state: LifecycleState = LifecycleState.READY,
    models: tuple[str, ...] = ("m",),
    received_at_s: float = 100.0,
    kv: float = 0.1,
    e2e_ms: float | None = 1000.0,
    inflight_at_receipt: int = 0,
    itl_ms: float | None = None,
    decode_tokens_per_s: float | None = None,
    ttft_ms: float | None = None,
) -> WorkerView:
    heartbeat = Heartbeat(
        worker_id=worker_id,
        region=region,
        endpoint=f"http://127.0.0.1:1/{worker_id}",
        models=models,
        state=state,
        capacity=Capacity(max_num_seqs=slots),
        load=Load(running=running, waiting=waiting, kv_cache_usage=kv),
        performance=Performance(e2e_ms=e2e_ms, prefill_tokens_per_s=10_000.0, itl_ms=itl_ms,
                                decode_tokens_per_s=decode_tokens_per_s, ttft_ms=ttft_ms),
        seq=1,
        sent_at_s=1.0,
        ttl_s=2.0,
    )
    return WorkerView(heartbeat, received_at_s, inflight_at_receipt)


def snapshot(*views: WorkerView, connected: bool = True, ok_at: float = 100.0) -> Snapshot:
    return Snapshot.build(views, built_at_s=100.0, redis_connected=connected,
                          last_redis_ok_at_s=ok_at)


COST = {"us-east": 3.0, "eu-west": 1.0}


def make_policy(
    name: str = "predicted_ttft", *, clock: FakeClock | None = None, seed: int = 7,
    inflight: InFlight | None = None, affinity: AffinityTable | None = None,
) -> Policy:
    context = RoutingContext(
        rtt_ms=rtt_ms, inflight=inflight or InFlight(), clock=clock or FakeClock(),
        rng=random.Random(seed), near_equal_ms=5.0, affinity=affinity or AffinityTable(),
        region_cost=lambda region: COST.get(region, 2.0),
    )
    return create_policy(name, context)


def pick(snap: Snapshot, *, origin: str = "us-east", exclude: frozenset[str] = frozenset(),
         model: str = "m", **kwargs: object) -> tuple[str, str]:
    policy = make_policy(**kwargs)  # type: ignore[arg-type]
    request = RouteRequest(model=model, origin_region=origin, prompt_tokens=100, exclude=exclude)
    decision = policy.pick(snap, request)
    return decision.worker.worker_id, decision.reason


def test_local_worker_wins_when_it_has_room() -> None:
    snap = snapshot(view("us-1"), view("eu-1", "eu-west"))
    assert pick(snap) == ("us-1", "local")
    assert pick(snap, origin="eu-west") == ("eu-1", "local")


def test_saturated_local_region_spills_to_the_next_best() -> None:
    # 8 slots, 24 queued: ~2 s of queue wait locally versus 80 ms RTT to eu-west.
    snap = snapshot(view("us-1", running=8, waiting=24), view("eu-1", "eu-west"))
    assert pick(snap) == ("eu-1", "spillover")


def test_spill_only_when_predicted_faster() -> None:
    # one request queued locally: 1 * 1000 ms / 8 = 125 ms > 80 ms RTT -> spill;
    # with a short service time the local queue is cheaper than the trip.
    busy = view("us-1", running=8, waiting=0, e2e_ms=400.0)
    assert pick(snapshot(busy, view("eu-1", "eu-west"))) == ("us-1", "local")
    busier = view("us-1", running=8, waiting=0, e2e_ms=1000.0)
    assert pick(snapshot(busier, view("eu-1", "eu-west"))) == ("eu-1", "spillover")


def test_filters_model_state_freshness_and_exclusions() -> None:
    clock = FakeClock(now=100.0)
    snap = snapshot(
        view("draining", state=LifecycleState.DRAINING),
        view("other-model", models=("x",)),
        view("stale", received_at_s=90.0),
        view("tried"),
        view("good", "eu-west"),
    )
    assert pick(snap, exclude=frozenset({"tried"}), clock=clock) == ("good", "spillover")
    with pytest.raises(NoRoute, match="can take a request now"):
        pick(snap, exclude=frozenset({"tried", "good"}), clock=clock)
    with pytest.raises(NoRoute, match="no worker serves the model 'unknown'") as caught:
        pick(snap, model="unknown")
    assert caught.value.model_known is False


def test_fail_static_keeps_workers_while_redis_is_down() -> None:
    # The view was last refreshed at t=100; at t=110 every heartbeat is past its TTL.
    clock = FakeClock(now=110.0)
    down = snapshot(view("us-1"), connected=False, ok_at=100.5)
    assert pick(down, clock=clock) == ("us-1", "local")
    up = snapshot(view("us-1"), connected=True, ok_at=110.0)
    with pytest.raises(NoRoute):
        pick(up, clock=clock)


def test_own_inflight_counts_between_heartbeats() -> None:
    inflight = InFlight()
    for _ in range(30):
        inflight.started("us-1")
    # The heartbeat showed an idle worker, but this router has sent it 30 requests since.
    snap = snapshot(view("us-1", slots=8), view("eu-1", "eu-west"))
    assert pick(snap, inflight=inflight) == ("eu-1", "spillover")
    # Requests already counted by the heartbeat are not counted twice (30, not 60, of 48).
    counted = snapshot(view("us-1", slots=48, running=30, inflight_at_receipt=30),
                       view("eu-1", "eu-west"))
    assert pick(counted, inflight=inflight) == ("us-1", "local")


def test_degraded_workers_are_tried_when_no_ready_one_is_left() -> None:
    degraded = view("us-1", state=LifecycleState.DEGRADED)
    assert pick(snapshot(degraded, view("eu-1", "eu-west"))) == ("eu-1", "spillover")
    assert pick(snapshot(degraded)) == ("us-1", "local")  # fail open, not a 503
    with pytest.raises(NoRoute):
        pick(snapshot(view("us-1", state=LifecycleState.STARTING)))


def test_near_equal_candidates_share_the_load() -> None:
    snap = snapshot(*(view(f"us-{i}") for i in range(4)))
    policy = make_policy(seed=3)
    request = RouteRequest(model="m", origin_region="us-east", prompt_tokens=10)
    counts = Counter(policy.pick(snap, request).worker.worker_id
                     for _ in range(400))
    assert set(counts) == {"us-0", "us-1", "us-2", "us-3"}
    assert min(counts.values()) > 50


def test_same_seed_same_choices() -> None:
    snap = snapshot(*(view(f"us-{i}") for i in range(4)))
    request = RouteRequest(model="m", origin_region="us-east")
    first, second = make_policy(seed=11), make_policy(seed=11)
    assert [first.pick(snap, request).worker.worker_id for _ in range(20)] == [
        second.pick(snap, request).worker.worker_id for _ in range(20)
    ]


def test_prediction_terms_in_milliseconds() -> None:
    # 9 requests ahead of a free slot at 8 slots per 800 ms, plus half the KV pressure range
    # of a service time, plus 5,000 tokens at the default prefill rate, plus the RTT.
    assert predicted_ms(80.0, 0.5 * 800, 5000, 0.1, 9, 800 / 8) == pytest.approx(
        80 + 900 + 400 + 500)
    assert predicted_ms(80.0, 0.0, 0, 0.1, -3, 100.0) == 80.0  # free slots: no wait


@pytest.mark.parametrize("many_workers", [False, True])
def test_every_way_of_scoring_predicts_the_same(many_workers: bool) -> None:
    """The general path, the small-pool pass and the ranked path (48+ workers) all give
    the chosen worker the prediction of `predicted_ms` over its view's terms."""
    busy = view("us-1", running=8, waiting=8, slots=8, e2e_ms=800.0, kv=0.95)
    idle = [view(f"eu-{i}", "eu-west", running=8, waiting=8, slots=8, e2e_ms=800.0,
                 kv=0.95) for i in range(60 if many_workers else 1)]
    snap = snapshot(busy, *idle)
    request = RouteRequest(model="m", origin_region="us-east", prompt_tokens=5000)
    expected = predicted_ms(RTT["us-east", "us-east"], busy.engine_ms, 5000,
                            busy.prefill_ms_per_token, busy.queue_base,
                            busy.queue_ms_per_request)
    # RTT, queue, KV pressure, prefill, and the first step: none, as no ITL is reported.
    assert expected == pytest.approx(1 + 900 + 400 + 500)
    decision = make_policy().pick(snap, request)
    assert decision.worker.worker_id == "us-1"  # the same terms, 80 ms nearer
    assert decision.predicted_ttft_ms == pytest.approx(expected)
    general = make_policy().choose([busy, *idle], request)
    assert general.predicted_ttft_ms == pytest.approx(expected)
    for chosen in (decision, general):
        assert chosen.prediction is not None
        assert chosen.prediction.total_ms == pytest.approx(expected)
        assert chosen.prediction.first_step_ms == 0.0
        assert chosen.prediction.queue_ms == pytest.approx(900 + 400)


def test_the_first_step_is_the_engines_inter_token_latency() -> None:
    """The first token comes at the end of the step that prefills the prompt: one ITL
    (busy or not: see WorkerView._derive)."""
    idle = view("us-1", running=0, itl_ms=40.0)
    busy = view("us-2", running=3, itl_ms=40.0)
    assert (idle.first_step_ms, busy.first_step_ms) == (40.0, 40.0)
    no_itl = view("us-3", running=0, decode_tokens_per_s=50.0)
    assert no_itl.first_step_ms == pytest.approx(20.0)  # 1 / decode rate
    snap = snapshot(idle)
    decision = make_policy().pick(snap, RouteRequest(model="m", origin_region="us-east"))
    assert decision.prediction is not None
    assert decision.predicted_ttft_ms == pytest.approx(decision.prediction.total_ms)
    assert decision.prediction.first_step_ms == 40.0


@pytest.mark.parametrize("name", ["round_robin", "random", "least_load", "nearest",
                                  "power_of_two"])
def test_baselines_predict_with_the_same_model(name: str) -> None:
    snap = snapshot(view("us-1", running=2, itl_ms=30.0))
    decision = make_policy(name).pick(snap, RouteRequest(model="m", origin_region="us-east",
                                                         prompt_tokens=100))
    assert decision.prediction is not None
    assert decision.predicted_ttft_ms == pytest.approx(decision.prediction.total_ms)
    assert decision.prediction.first_step_ms == pytest.approx(30.0)


def test_round_robin_baseline_cycles() -> None:
    snap = snapshot(view("a"), view("b"), view("c", "eu-west"))
    policy = make_policy("round_robin")
    request = RouteRequest(model="m", origin_region="us-east")
    assert [policy.pick(snap, request).worker.worker_id for _ in range(4)] == [
        "a", "b", "c", "a"]


def test_unknown_policy_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"known: .*predicted_ttft"):
        make_policy("fastest")


def test_baselines_are_registered_and_behave() -> None:
    snap = snapshot(view("us-1", running=6), view("us-2", running=1),
                    view("eu-1", "eu-west", running=0))
    request = RouteRequest(model="m", origin_region="us-east")
    assert make_policy("least_load").pick(snap, request).worker.worker_id == "eu-1"
    nearest = make_policy("nearest")
    assert {nearest.pick(snap, request).worker.worker_id for _ in range(10)} == {"us-2"}
    with pytest.raises(NoRoute, match="never leaves"):
        nearest.pick(snapshot(view("eu-1", "eu-west")), request)
    chosen = Counter(make_policy("random", seed=s).pick(snap, request).worker.worker_id
                     for s in range(60))
    assert set(chosen) == {"us-1", "us-2", "eu-1"}
    two = make_policy("power_of_two", seed=1)
    assert Counter(two.pick(snap, request).worker.worker_id for _ in range(60))["us-1"] < 20


def test_affinity_returns_to_the_worker_with_the_cached_prefix() -> None:
    affinity = AffinityTable()
    affinity.remember("session-1", (), "us-2", prompt_tokens=1500)
    snap = snapshot(view("us-1"), view("us-2", running=2))
    request = RouteRequest(model="m", origin_region="us-east", prompt_tokens=2000,
                           session_id="session-1", prefix_keys=(7,))
    decision = make_policy(affinity=affinity).pick(snap, request)
    assert (decision.worker.worker_id, decision.reason) == ("us-2", "affinity")
    assert affinity.hits == 1


def test_affinity_never_follows_onto_an_overloaded_worker() -> None:
    affinity = AffinityTable()
    affinity.remember(None, (41, 42, 43), "us-2")
    # us-2 has 40 requests queued: seconds of wait; the cached prefix cannot make up for it.
    snap = snapshot(view("us-1"), view("us-2", running=8, waiting=40))
    request = RouteRequest(model="m", origin_region="us-east", prompt_tokens=2000,
                           prefix_keys=(41, 42, 43))
    decision = make_policy(affinity=affinity).pick(snap, request)
    assert (decision.worker.worker_id, decision.reason) == ("us-1", "local")


def test_a_session_turn_is_priced_with_its_history_cached_on_the_affine_worker() -> None:
    # 6,000 prompt tokens at 10,000 tokens/s: 600 ms of prefill on the idle us-1. us-2
    # served the previous turn (5,000 tokens, all repeated in this one) and has two
    # requests' worth of queue (250 ms): 250 + 100 ms there beats 600 ms anywhere else.
    # Only the shared prefix (256 tokens) would price us-2 at 824 ms: not followed.
    snap = snapshot(view("us-1"), view("us-2", running=8, waiting=1))

    def chosen(affinity: AffinityTable, session_id: str | None, prefix_keys: tuple[int, ...]
               ) -> str:
        request = RouteRequest(model="m", origin_region="us-east", prompt_tokens=6000,
                               session_id=session_id, prefix_keys=prefix_keys)
        decision = make_policy(affinity=affinity).pick(snap, request)
        return f"{decision.worker.worker_id} {decision.reason}"

    session = AffinityTable()
    session.remember("session-1", (7,), "us-2", prompt_tokens=5000)
    assert chosen(session, "session-1", (7,)) == "us-2 affinity"
    assert session.lookup("session-1", (7,)) == {"us-2": 5000}
    # Another conversation that shares only the first 1k characters (256 tokens) gets
    # that discount only.
    assert session.lookup(None, (7, 8)) == {"us-2": 256}
    assert chosen(session, "session-2", (7, 8)) == "us-1 local"
    assert chosen(AffinityTable(), "session-1", (7,)) == "us-1 local"


def test_a_long_shared_prefix_is_credited_by_its_longest_shared_key() -> None:
    # 6,000 prompt tokens; us-2 served a request sharing the first 16k characters (keys
    # of 1k..16k: 4,096 tokens): 600 - 410 ms of prefill saved outweighs its queue.
    snap = snapshot(view("us-1"), view("us-2", running=8, waiting=1))
    affinity = AffinityTable()
    affinity.remember(None, (1, 2, 3, 4, 5, 90), "us-2")  # then another 16k differed
    affinity.remember(None, (1, 2, 3), "us-3")
    assert affinity.lookup(None, (1, 2, 3, 4, 5, 6)) == {"us-2": 4096, "us-3": 1024}
    request = RouteRequest(model="m", origin_region="us-east", prompt_tokens=6000,
                           prefix_keys=(1, 2, 3, 4, 5, 6))
    decision = make_policy(affinity=affinity).pick(snap, request)
    assert (decision.worker.worker_id, decision.reason) == ("us-2", "affinity")
    assert decision.prediction is not None
    assert decision.prediction.prefill_ms == pytest.approx((6000 - 4096) * 0.1)


def test_every_recent_holder_of_a_prefix_is_credited() -> None:
    affinity = AffinityTable()
    for worker in ("a", "b", "c", "d", "e", "b"):
        affinity.remember(None, (1,), worker)
    # the four most recent distinct holders, the latest first
    assert list(affinity.lookup(None, (1,))) == ["b", "e", "d", "c"]
    assert affinity.lookup(None, (2,)) == {}
    assert (affinity.lookups, affinity.hits) == (2, 1)



def test_batch_goes_to_the_cheapest_region_with_spare_slots() -> None:
    snap = snapshot(view("us-1"), view("eu-1", "eu-west", running=2))
    batch = RouteRequest(model="m", origin_region="us-east", traffic_class="batch")
    decision = make_policy().pick(snap, batch)
    assert (decision.worker.worker_id, decision.reason) == ("eu-1", "batch")
    # The cheap region's slots are (nearly) full: batch must not queue behind them.
    busy = snapshot(view("us-1"), view("eu-1", "eu-west", running=7))
    assert make_policy().pick(busy, batch).worker.worker_id == "us-1"
    full = snapshot(view("us-1", running=8, waiting=3), view("eu-1", "eu-west", running=8))
    assert make_policy().pick(full, batch).reason == "batch_queued"


def test_ttft_budget_is_honoured_when_it_can_be_and_reported() -> None:
    snap = snapshot(view("us-1"), view("eu-1", "eu-west"))
    cheap_in_budget = RouteRequest(model="m", origin_region="us-east", traffic_class="batch",
                                   ttft_budget_ms=40.0)
    decision = make_policy().pick(snap, cheap_in_budget)
    # eu-west is cheaper but 80 ms away: over the 40 ms budget, so us-east it is.
    assert (decision.worker.worker_id, decision.budget_met) == ("us-1", True)
    tight = RouteRequest(model="m", origin_region="eu-west", ttft_budget_ms=0.5)
    assert make_policy().pick(snap, tight).budget_met is False
    assert make_policy().pick(snap, RouteRequest(model="m", origin_region="us-east")
                              ).budget_met is None


def test_large_pools_consider_the_least_loaded_of_each_region() -> None:
    import router.policy.filters as filters

    views = [view(f"us-{i}", running=i % 8) for i in range(300)]
    views += [view(f"eu-{i}", "eu-west", running=0) for i in range(300)]
    snap = snapshot(*views)
    assert "m" in snap.ranked
    request = RouteRequest(model="m", origin_region="us-east",
                           exclude=frozenset({"us-0"}))
    chosen = filters.eligible(snap, request, 100.0)
    assert len(chosen) == 2 * filters.SAMPLE_PER_REGION
    assert all(v.running == 0 for v in chosen)
    assert "us-0" not in {v.worker_id for v in chosen}
    decision = make_policy().pick(snap, request)
    assert decision.worker.region == "us-east" and decision.worker.running == 0


def test_large_pools_skip_regions_that_cannot_win_and_choose_as_if_they_had_not() -> None:
    from lab.benchproxy.decision import MODEL, REGIONS, fleet, ten_regions
    from router.health import Health

    rng = random.Random(3)
    views = fleet(2_000, rng, 100.0)
    snap = Snapshot.build(views, built_at_s=100.0, redis_connected=True,
                          last_redis_ok_at_s=100.0)
    inflight = InFlight()
    for chosen in rng.sample(views, 50):
        inflight.started(chosen.worker_id)
    affinity = AffinityTable()
    for session in range(20):
        affinity.remember(f"s-{session}", (session,), rng.choice(views).worker_id,
                          prompt_tokens=rng.randint(0, 500))
    # near_equal_ms=0: the best candidate wins outright, so both paths must agree exactly.
    policy = create_policy("predicted_ttft", RoutingContext(
        rtt_ms=ten_regions().rtt_ms, inflight=inflight, clock=FakeClock(), near_equal_ms=0.0,
        health=Health(clock=FakeClock()), affinity=affinity))
    pruned, full = [], []
    for i in range(400):
        request = RouteRequest(
            model=MODEL, origin_region=rng.choice(REGIONS), prompt_tokens=rng.randint(10, 2000),
            session_id=f"s-{i % 40}" if i % 3 == 0 else None,
            prefix_keys=(i % 30, 100) if i % 5 == 0 else ())
        fast = policy.pick(snap, request)
        slow = Policy.pick(policy, snap, request)  # every region's candidates, then choose
        assert (fast.worker.worker_id, fast.reason) == (slow.worker.worker_id, slow.reason)
        assert fast.predicted_ttft_ms == pytest.approx(slow.predicted_ttft_ms)
        pruned.append(fast.candidates)
        full.append(slow.candidates)
    assert sum(pruned) < 0.6 * sum(full), (sum(pruned), sum(full))


def test_small_pools_choose_in_one_pass_exactly_as_the_general_path_does() -> None:
    from router.health import Health

    rng = random.Random(5)
    states = [LifecycleState.READY] * 6 + [LifecycleState.DRAINING, LifecycleState.DEGRADED]
    plain = general = 0
    for trial in range(300):
        regions = rng.sample(["us-east", "eu-west", "ap-south"], rng.randint(1, 3))
        views = [view(f"w-{i}", rng.choice(regions), running=rng.randint(0, 10),
                      waiting=rng.randint(0, 3), slots=rng.choice((4, 8, 16)),
                      state=rng.choice(states), kv=rng.uniform(0.0, 0.95),
                      received_at_s=rng.choice((100.0, 100.0, 100.0, 98.0, 97.0)),
                      inflight_at_receipt=rng.randint(0, 2))
                 for i in range(rng.randint(0, 12))]
        snap = snapshot(*views)
        inflight = InFlight()
        for chosen in views:
            for _ in range(rng.randint(0, 3)):
                inflight.started(chosen.worker_id)
        seed, near_equal_ms = rng.random(), rng.choice((0.0, 5.0, 50.0))
        fast, slow = (create_policy("predicted_ttft", RoutingContext(
            rtt_ms=rtt_ms, inflight=inflight, clock=FakeClock(), rng=random.Random(seed),
            near_equal_ms=near_equal_ms, health=Health(clock=FakeClock()))) for _ in range(2))
        for _ in range(5):
            exclude = frozenset(rng.sample([v.worker_id for v in views],
                                           min(len(views), rng.choice((0, 0, 1, 2)))))
            request = RouteRequest(model=rng.choice(("m", "m", "other")),
                                   origin_region=rng.choice(("us-east", "eu-west", None)),
                                   prompt_tokens=rng.randint(1, 4000), exclude=exclude,
                                   ttft_budget_ms=rng.choice((None, 50.0)))
            try:
                got = fast.pick(snap, request)
            except NoRoute as exc:
                with pytest.raises(NoRoute) as expected:
                    Policy.pick(slow, snap, request)
                assert str(exc) == str(expected.value)
                general += 1
                continue
            want = Policy.pick(slow, snap, request)  # eligible, health filter, choose
            assert (got.worker.worker_id, got.reason, got.candidates, got.budget_met) == (
                want.worker.worker_id, want.reason, want.candidates, want.budget_met), trial
            assert got.predicted_ttft_ms == want.predicted_ttft_ms
            plain += 1
    assert plain > 600 and general > 50, (plain, general)


def test_two_of_draws_two_different_items_uniformly() -> None:
    rng = random.Random(7)
    pairs: Counter[tuple[int, int]] = Counter()
    for _ in range(12_000):
        first, second = two_of([0, 1, 2, 3], rng)
        assert first != second
        pairs[(first, second)] += 1
    assert len(pairs) == 12  # every ordered pair of different items
    assert min(pairs.values()) > 800 and max(pairs.values()) < 1200  # expected 1,000 each
    assert two_of(["a", "b"], rng) in (("a", "b"), ("b", "a"))


def test_a_full_engine_of_long_requests_is_priced_by_the_work_they_committed() -> None:
    """Right after 2-token answers (E2E 100 ms), 16 requests of 600 tokens fill us-east's
    16 slots. Priced by that E2E, a 17th would wait 6 ms there and stay; priced by what
    the open requests still have to generate (600 steps of 50 ms each), it goes 80 ms
    away to eu-west's free slots."""
    us = view("us-1", running=0, slots=16, e2e_ms=100.0, itl_ms=50.0)
    eu = view("eu-1", "eu-west", running=0, slots=16, e2e_ms=100.0, itl_ms=50.0)
    snap = snapshot(us, eu)
    request = RouteRequest(model="m", origin_region="us-east", prompt_tokens=10,
                           completion_tokens=600)
    blind = make_policy()
    for _ in range(16):
        blind.context.inflight.started("us-1")  # the burst, without its lengths
    assert blind.pick(snap, request).worker.worker_id == "us-1"
    seeing = make_policy()
    clock = seeing.context.clock()
    for _ in range(16):
        seeing.context.inflight.started("us-1")
        seeing.context.inflight.commit(sent("us-1", clock), 600, 0, clock)
    decision = seeing.pick(snap, request)
    assert decision.worker.worker_id == "eu-1", decision
    parts = seeing.pick(snapshot(us), request).prediction
    assert parts is not None and parts.queue_ms == pytest.approx(600 * 50.0 / 16, rel=0.01)


def sent(worker_id: str, at_s: float) -> Attempt:
    return Attempt(worker_id=worker_id, region="us-east", predicted_ttft_ms=0.0,
                   reason="local", started_s=at_s, streamed=True)


def test_prompts_sent_ahead_and_not_yet_prefilled_delay_the_next_first_token() -> None:
    """A 16,000-token prompt that this router sent us-1 is prefilled there before, or in
    the same step as, the next request (10,000 tokens/s: 1.6 s): the next goes to us-2,
    by either way of scoring. Once its first byte came, the two are equal again. A queued
    worker's queue price covers what waits there: nothing is added twice."""
    policy = make_policy()
    inflight = policy.context.inflight
    clock = policy.context.clock()
    one, two = view("us-1"), view("us-2")
    request = RouteRequest(model="m", origin_region="us-east", prompt_tokens=100)
    long_prompt = sent("us-1", clock)
    inflight.started("us-1")
    inflight.commit(long_prompt, 0, 16_000, clock)
    for _ in range(20):  # the plain path, and `choose` (what ranked and affine picks score)
        assert policy.pick(snapshot(one, two), request).worker.worker_id == "us-2"
        assert policy.choose([one, two], request).worker.worker_id == "us-2"
    parts = policy.pick(snapshot(one), request).prediction
    assert parts is not None and parts.prefill_ms == pytest.approx(1610.0)
    long_prompt.first_byte(clock + 0.2)
    chosen = {policy.pick(snapshot(one, two), request).worker.worker_id for _ in range(40)}
    assert chosen == {"us-1", "us-2"}
    full = view("us-1", running=8, waiting=2)  # queued: priced by its queue alone
    queued = policy.choose([full], request)
    inflight.commit(sent("us-1", clock), 0, 16_000, clock)
    assert policy.choose([full], request).predicted_ttft_ms == queued.predicted_ttft_ms


def test_a_holder_is_dropped_once_the_worker_was_sent_more_than_its_cache_holds() -> None:
    affinity = AffinityTable()
    affinity.wrote("a", 3000, 8192)
    affinity.remember(None, (1, 2), "a")
    affinity.wrote("b", 100, None)  # an engine that does not say its cache size
    affinity.remember(None, (1, 2), "b")
    affinity.wrote("a", 8000, 8192)  # 8,000 new tokens since: the prefix may still be there
    affinity.wrote("b", 10**9, None)
    assert affinity.lookup(None, (1, 2)) == {"a": 512, "b": 512}
    affinity.wrote("a", 200, 8192)  # 8,200 > 8,192: evicted by now
    assert affinity.lookup(None, (1, 2)) == {"b": 512}
    affinity.remember(None, (1, 2), "a")  # served again: cached again
    assert affinity.lookup(None, (1, 2)) == {"a": 512, "b": 512}


def test_a_worker_whose_streams_are_late_now_gives_its_requests_to_its_sibling() -> None:
    """A stream waiting on us-1 far beyond its prediction (its path or engine slowed just
    now) makes us-1 look that much slower: new requests go to us-2, still in us-east, not
    away from the region on one worker's evidence."""
    from router.core.outcome import Attempt
    from router.health import Health

    clock = FakeClock(100.0)
    views = {v.worker_id: v for v in (view("us-1"), view("us-2"), view("eu-1", "eu-west"))}
    health = Health(clock=clock, views=lambda: views)
    policy = create_policy("predicted_ttft", RoutingContext(
        rtt_ms=rtt_ms, inflight=InFlight(), clock=clock, rng=random.Random(7),
        near_equal_ms=5.0, health=health))
    snap = snapshot(*views.values())
    request = RouteRequest(model="m", origin_region="us-east", prompt_tokens=100)
    late = Attempt(worker_id="us-1", region="us-east", predicted_ttft_ms=20.0,
                   reason="local", started_s=100.0, streamed=True)
    health.dispatched(late)
    clock.now = 100.6
    health.check_overdue()
    chosen = {policy.pick(snap, request).worker.worker_id for _ in range(20)}
    assert chosen == {"us-2"}
