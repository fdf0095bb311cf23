"""What batch lines leave free for interactive requests (router.policy.batch_room), and how
the `batch` class and the runner's pacing use it.

The old rule kept a quarter of each worker's slots free after everything that ran; a batch
filled the rest while interactive load swung from 5 to over 10 of 16 slots, and requests
that found every slot taken waited for a batch line to end (bench-batch: TTFT p99 3.9x)."""

from __future__ import annotations

import itertools
import math
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.batch.room import StartPace
from router.policy import RouteRequest
from router.policy.batch_room import (
    FORGET_S,
    LEARN_DECAY_PER_S,
    LEARN_S,
    MARGIN_SLOTS,
    MIN_RESERVE_SHARE,
    PEAK_DECAY_PER_S,
    BatchRoom,
)
from router.registry.inflight import InFlight
from router.registry.worker_view import WorkerView
from tests.unit.test_policy import FakeClock, make_policy, snapshot, view


def beat(at_s: float, slots: int = 16) -> WorkerView:
    """Worker w's heartbeat received at `at_s` (the load is passed to `room` apart)."""
    return view("w", slots=slots, received_at_s=at_s)


T = LEARN_S + 2.0  # when a worker first seen has been learnt (see `learnt`)


def learnt(room: BatchRoom, load: int, slots: int = 16) -> None:
    """Worker w seen at `load` in a heartbeat every 0.5 s from 0 to T."""
    for tick in range(int(2 * T) + 1):
        room.room(beat(tick / 2, slots), load, now_s=tick / 2)


def test_a_worker_first_seen_starts_with_little_room_and_learns_its_load() -> None:
    # Nothing is known of its swings yet: three quarters of its slots are held back,
    # falling back by LEARN_DECAY_PER_S while it shows what its interactive load does.
    room = BatchRoom()
    assert room.room(beat(0.0), 0, now_s=0.0) == 16 - 12 - MARGIN_SLOTS
    assert room.room(beat(4.0), 0, now_s=4.0) == 16 - (12 - 4 * LEARN_DECAY_PER_S) - MARGIN_SLOTS
    assert room.room(beat(8.0), 0, now_s=8.0) == 16 - 4 - MARGIN_SLOTS
    assert room.peak_of("w") == 0  # what it showed; the guess is apart
    # What it shows meanwhile falls back only as any peak does.
    room.room(beat(8.5), 7, now_s=8.5)
    room.room(beat(9.0), 7, now_s=9.0)
    assert room.room(beat(9.5), 0, now_s=9.5) == 16 - 7 - MARGIN_SLOTS
    assert room.room(beat(15.0), 0, now_s=15.0) == 16 - 7 - MARGIN_SLOTS
    # A worker whose interactive load is 9 never gets less held back than that.
    busy = BatchRoom()
    learnt(busy, 9)
    assert busy.peak_of("w") == 9


def test_the_peak_of_interactive_load_is_kept_free_and_falls_back_slowly() -> None:
    room = BatchRoom()
    learnt(room, 10)
    # Interactive load falls to 3: the fixed quarter would give 16 - 4 - 3 = 9 slots, but
    # the peak is remembered, falling back by PEAK_DECAY_PER_S.
    assert room.room(beat(T + 0.5), 3, now_s=T + 0.5) == 16 - 10 - MARGIN_SLOTS
    after = T + 20.0
    peak = 10 - PEAK_DECAY_PER_S * (after - T)
    assert room.room(beat(after), 3, now_s=after) == 16 - math.ceil(peak) - MARGIN_SLOTS
    assert room.peak_of("w") == pytest.approx(peak)
    # Not seen for longer than FORGET_S: nothing is known again.
    later = after + FORGET_S + 1
    assert room.room(beat(later), 3, now_s=later) == 16 - 12 - MARGIN_SLOTS


def test_a_load_one_heartbeat_shows_is_not_taken_for_a_peak() -> None:
    # A heartbeat is taken before it arrives: 3 lines that ended in between are in its
    # load and no longer in the router's count, so it seems to show 3 more interactive
    # requests. Kept as a peak, they would hold slots back for 30 s.
    room = BatchRoom()
    learnt(room, 4)
    assert room.room(beat(T + 0.5), 7, now_s=T + 0.5) == 16 - 4 - 7  # (the quarter binds)
    assert room.peak_of("w") == 4
    assert room.room(beat(T + 1.0), 4, now_s=T + 1.0) == 16 - 4 - 4  # not 16 - 7 - 2
    # Two heartbeats in a row at 7: that is interactive load.
    assert room.room(beat(T + 1.5), 7, now_s=T + 1.5) == 16 - 4 - 7
    assert room.room(beat(T + 2.0), 7, now_s=T + 2.0) == 16 - 4 - 7
    assert room.peak_of("w") == 7
    assert room.room(beat(T + 2.5), 2, now_s=T + 2.5) == 16 - 7 - MARGIN_SLOTS


def test_own_batch_lines_are_not_taken_for_interactive_load() -> None:
    room = BatchRoom()
    learnt(room, 4)
    for _ in range(6):
        room.started("w")
    # The worker holds 10 (4 interactive + 6 lines): the peak stays 4.
    assert room.room(beat(T + 0.5), 10, now_s=T + 0.5) == 16 - 4 - 10
    assert room.room(beat(T + 1.0), 10, now_s=T + 1.0) == 16 - 4 - 10
    assert room.peak_of("w") == 4
    # Its interactive requests end: 6 lines left, the peak's 4 + 2 kept, so 4 more lines
    # (had the lines counted as interactive load, the peak would be 10, and none).
    assert room.room(beat(T + 1.5), 6, now_s=T + 1.5) == 16 - 4 - MARGIN_SLOTS - 6
    for _ in range(10):  # more ends than starts (a cancelled attempt) never go negative
        room.finished("w")
    assert room.batch_of("w") == 0


def test_a_queue_or_an_absurd_load_holds_every_slot_and_no_more() -> None:
    # 200 waiting on a 16-slot worker (a burst), or a lying heartbeat's 10,000,000: the
    # peak is the worker's slots, and falls back from there. Kept as the queue's length,
    # it would hold the worker's slots back from batch lines for hours.
    for load in (216, 10_000_000):
        room = BatchRoom()
        learnt(room, 4)
        room.room(beat(T + 0.5), load, now_s=T + 0.5)
        room.room(beat(T + 1.0), load, now_s=T + 1.0)
        assert room.peak_of("w") == 16
        for later in (T + 21.0, T + 41.0, T + 61.0):  # (seen: not forgotten)
            free = room.room(beat(later), 4, now_s=later)
        assert room.peak_of("w") == pytest.approx(16 - 60 * PEAK_DECAY_PER_S)
        assert free == 16 - 10 - MARGIN_SLOTS


def test_a_fixed_share_is_the_old_rule() -> None:
    room = BatchRoom(lambda: 0.25)
    assert room.room(beat(0.0), 10, now_s=0.0) == 2  # 16 - 4 - 10: nothing to learn
    assert room.room(beat(0.5), 10, now_s=0.5) == 2
    assert room.room(beat(1.0), 3, now_s=1.0) == 9  # no memory of the peak
    assert BatchRoom(lambda: 0.0).room(beat(0.0), 3, now_s=0.0) == 13


def test_workers_gone_are_not_remembered_forever() -> None:
    room = BatchRoom()
    for number in range(1000):
        at = number * 1.0
        room.room(view(f"w{number}", received_at_s=at), 1, now_s=at)
    assert len(room._peaks) < 200


@settings(max_examples=500, deadline=None)
@given(slots=st.integers(4, 64),
       steps=st.lists(st.tuples(st.floats(0.0, 1.0), st.floats(0.0, 0.5),
                                st.floats(0.0, 0.6), st.booleans()), min_size=1, max_size=60))
def test_batch_lines_never_take_what_interactive_load_held_within_the_decay(
        slots: int, steps: list[tuple[float, float, float, bool]]) -> None:
    """Whatever the loads seen, heartbeats, lines added and time passed: room never lets
    batch lines reach the slots that an interactive load two heartbeats in a row showed
    within the last second needs, nor go past the fixed quarter."""
    room = BatchRoom()
    learnt(room, 0, slots)
    now = heartbeat = T
    shown = [(T, T, 0)]  # (when, in which heartbeat, interactive load): learnt's last
    for interactive_share, lines_share, dt, new_heartbeat in steps:
        interactive, lines = round(interactive_share * slots), round(lines_share * slots)
        now += dt
        if new_heartbeat:
            heartbeat = now
        for _ in range(lines - room.batch_of("w")):
            room.started("w")
        for _ in range(room.batch_of("w") - lines):
            room.finished("w")
        load = interactive + lines
        free = room.room(beat(heartbeat, slots), load, now)
        shown.append((now, heartbeat, interactive))
        assert load + free <= slots - math.ceil(slots * MIN_RESERVE_SHARE)
        # Every two heartbeats in a row seen within the last second: the least of what
        # they showed is interactive load the peak holds (falling 0.1 slot a second).
        recent = [(seen_in, level) for at, seen_in, level in shown if now - at <= 1.0]
        if any(now - at > 1.0 for at, seen_in, _ in shown if seen_in == recent[0][0]):
            recent = [(seen_in, level) for seen_in, level in recent if seen_in != recent[0][0]]
        least: dict[float, int] = {}
        for seen_in, level in recent:
            least[seen_in] = min(least.get(seen_in, level), level)
        beats = sorted(least)
        held = max((min(least[one], least[next_one])
                    for one, next_one in itertools.pairwise(beats)), default=0)
        assert lines + free <= slots - held - MARGIN_SLOTS


def test_a_batch_line_goes_only_where_interactive_traffic_leaves_room() -> None:
    clock = FakeClock(100.0 - T)
    policy = make_policy(clock=clock)
    line = RouteRequest(model="m", origin_region="us-east", traffic_class="batch",
                        paced=True)
    # Both workers learnt idle; eu-west is cheaper.
    while clock.now < 100.0:
        idle = snapshot(view("us-1", received_at_s=clock.now),
                        view("eu-1", "eu-west", received_at_s=clock.now))
        policy.pick(idle, line)
        clock.now += 0.5
    assert policy.pick(idle, line).worker.worker_id == "eu-1"
    # Then eu-west's worker carries 6 interactive requests of 8, in two heartbeats.
    for received in (100.5, 101.0):
        clock.now = received
        busy = snapshot(view("us-1"), view("eu-1", "eu-west", running=6,
                                           received_at_s=received))
        assert policy.pick(busy, line).worker.worker_id == "us-1"
    quiet_now = snapshot(view("us-1"), view("eu-1", "eu-west", running=1,
                                            received_at_s=101.5))
    decision = policy.pick(quiet_now, line)
    assert (decision.worker.worker_id, decision.reason) == ("us-1", "batch")
    # A client's batch-class request keeps the fixed rule: the cheap region, 1 + 1 <= 6.
    client_batch = RouteRequest(model="m", origin_region="us-east", traffic_class="batch")
    assert policy.pick(quiet_now, client_batch).worker.worker_id == "eu-1"
    # Once the peak has fallen back, lines go to the cheap region again.
    clock.now += (6 + MARGIN_SLOTS + 1 - 8) / PEAK_DECAY_PER_S + 1.0
    assert policy.pick(quiet_now, line).worker.worker_id == "eu-1"


def test_a_runner_holds_lines_for_the_slots_that_free_before_its_next_scan() -> None:
    pace = StartPace()
    assert pace.ahead(running=0, interval_s=0.5) == 0  # nothing runs: the spare slots only
    assert pace.ahead(running=12, interval_s=0.5) == 12  # a line for each one running
    start = time.monotonic() + 1.0  # (the scans' clock)
    pace.measure(start)
    for _ in range(40):  # 40 lines started in half a second: 80 a second
        pace.started()
    pace.measure(start + 0.5)
    assert pace.rate == pytest.approx(80)
    assert pace.ahead(running=12, interval_s=0.5) == math.ceil(pace.rate * 0.75)  # ~60
    pace.measure(start + 1.0)  # none started since: the rate falls halfway a scan
    assert pace.rate == pytest.approx(40)


def test_a_peers_batch_lines_hold_slots_but_are_not_interactive_load() -> None:
    # Worker w (32 slots) carries 4 interactive requests and 12 lines of another replica,
    # as the peer's reports say. Counted as interactive (the rule before they were
    # reported), the peer's lines made a peak of 16 that held 12 slots back for tens of
    # seconds after they ended: two replicas sharing a batch ran fewer lines than one.
    inflight = InFlight()
    peer_batch = inflight.peer_batch
    room = BatchRoom(inflight=inflight)
    blind = BatchRoom()  # (no reports of the peer's lines)
    for each in (room, blind):
        learnt(each, 4, slots=32)
    peer_batch["w"] = 12
    quarter = math.ceil(32 * MIN_RESERVE_SHARE)
    for tick in range(4):
        at = T + 0.5 * (tick + 1)
        # (what the quarter kept free after everything that runs leaves)
        assert room.room(beat(at, 32), 4 + 12, now_s=at) == 32 - quarter - 4 - 12
        blind.room(beat(at, 32), 4 + 12, now_s=at)
    assert room.peak_of("w") == 4 and blind.peak_of("w") == 16
    peer_batch.clear()  # the peer's lines ended
    after = T + 3.0
    assert room.room(beat(after, 32), 4, now_s=after) == 32 - quarter - 4  # all it may
    assert blind.room(beat(after, 32), 4, now_s=after) < 32 - quarter - 4
    # What it reports: its own lines, as a copy.
    room.started("w")
    counts = room.counts()
    room.started("w")
    assert counts == {"w": 1} and room.counts() == {"w": 2}


def test_replicas_that_hold_lines_for_a_workers_model_split_its_room() -> None:
    # Worker w (16 slots, 2 interactive, learnt): 10 slots for every replica's lines (the
    # quarter kept free after everything). Replica "a" holds lines for model "m" too: each
    # may fill half, whatever it knows of the other's lines meanwhile.
    inflight = InFlight()
    room = BatchRoom(inflight=inflight, me="b")
    learnt(room, 2)
    whole = min(16 - 2 - MARGIN_SLOTS, 16 - math.ceil(16 * MIN_RESERVE_SHARE) - 2)
    assert room.room(beat(T + 0.5), 2, now_s=T + 0.5) == whole  # no peer holds lines
    inflight.apply_peer("a", {}, 1.0, ready=frozenset({"m"}))
    assert room.room(beat(T + 1.0), 2, now_s=T + 1.0) == whole // 2
    for _ in range(whole // 2):
        room.started("w")
    assert room.room(beat(T + 1.5), 2 + whole // 2, now_s=T + 1.5) == 0  # its half, full
    # A peer that holds lines only for another model leaves this worker's room alone.
    other = BatchRoom(inflight=InFlight(), me="b")
    learnt(other, 2)
    other._inflight.apply_peer("a", {}, 1.0, ready=frozenset({"other-model"}))
    assert other.room(beat(T + 0.5), 2, now_s=T + 0.5) == whole
    # Once the peer holds no more lines, this replica may fill what the peer left.
    inflight.apply_peer("a", {"w": 1}, 2.0)
    assert inflight.peer_ready == {}
    assert room.room(beat(T + 2.0), 3 + whole // 2, now_s=T + 2.0) == whole - whole // 2 - 1


@pytest.mark.parametrize("whole_slots", [16, 17])
def test_a_rooms_shares_add_up_to_it_the_remainder_going_first_by_id(whole_slots: int) -> None:
    peers = ["a", "b", "c"]
    shares = []
    for me in peers:
        inflight = InFlight()
        for peer in peers:
            if peer != me:
                inflight.apply_peer(peer, {}, 1.0, ready=frozenset({"m"}))
        shares.append(BatchRoom(inflight=inflight, me=me).share(beat(0.0), whole_slots))
    assert sum(shares) == whole_slots and max(shares) - min(shares) <= 1
    assert shares == sorted(shares, reverse=True)


@settings(max_examples=200, deadline=None)
@given(
    interactive=st.integers(0, 12),
    # How many of the other's lines each replica knows of at each of its looks: its last
    # report (sent every 50 ms) may be old by any number of lines.
    seen_a=st.lists(st.floats(0, 1), min_size=1, max_size=40),
    seen_b=st.lists(st.floats(0, 1), min_size=1, max_size=40),
)
def test_two_replicas_never_start_more_lines_than_the_room_whatever_they_know_of_each_other(
        interactive: int, seen_a: list[float], seen_b: list[float]) -> None:
    # Two replicas that both hold lines for model "m" look for room on worker w in turns
    # and start a line whenever they see some. The heartbeat in their hands shows the
    # interactive load and none of the lines (they are on their way); each knows only
    # part of the other's lines (its reports lag). Before rooms were shared, each could
    # fill the whole room: up to twice the lines the worker may hold.
    rooms = {}
    for me, other in (("a", "b"), ("b", "a")):
        inflight = InFlight()
        inflight.apply_peer(other, {}, 1.0, ready=frozenset({"m"}))
        rooms[me] = BatchRoom(inflight=inflight, me=me)
        learnt(rooms[me], interactive)
    whole = min(16 - interactive - MARGIN_SLOTS, 16 - math.ceil(16 * MIN_RESERVE_SHARE)
                - interactive)
    at = T + 0.5
    for look_a, look_b in itertools.zip_longest(seen_a, seen_b):
        for me, other, look in (("a", "b", look_a), ("b", "a", look_b)):
            if look is None:
                continue
            known = int(look * rooms[other].batch_of("w"))
            rooms[me]._inflight.peer_batch["w"] = known
            if rooms[me].room(beat(T), interactive + rooms[me].batch_of("w") + known,
                              now_s=at) > 0:
                rooms[me].started("w")
    assert rooms["a"].batch_of("w") + rooms["b"].batch_of("w") <= max(0, whole)
