"""Open requests per worker: a router's own and its peers' reports (router.registry.inflight),
and the peer reports' wire format (router.registry.peers)."""

from __future__ import annotations

import json

import pytest

from router.core.outcome import Attempt
from router.core.stats import SecurityStats
from router.policy.affinity import AffinityTable
from router.registry import peers as peers_module
from router.registry.inflight import InFlight
from router.registry.peer_reports import (
    MAX_OPEN_PER_WORKER,
    MAX_PREFILL_PER_WORKER,
    MAX_READY_MODELS,
    MAX_REPORT_BYTES,
    ReportError,
    decode_report,
    decode_report_from,
    encode_report,
)
from router.registry.peers import KEEPALIVE_S, PeerExchange
from router.registry.shared_sends import MAX_SHARED_SERVED, MAX_WROTE_PER_WORKER, SharedSends

KEYS = {"k1": b"0123456789abcdef0123", "k2": b"fedcba9876543210fedc"}


def test_own_requests_and_peers_reports_add_up() -> None:
    inflight = InFlight()
    inflight.started("w1")
    inflight.started("w1")
    inflight.apply_peer("r2", {"w1": 3, "w2": 1}, now_s=1.0)
    assert (inflight.of("w1"), inflight.of("w2")) == (5, 1)
    assert (inflight.own_of("w1"), inflight.own_of("w2"), inflight.own_total()) == (2, 0, 2)
    assert inflight.own_counts() == {"w1": 2}
    # A peer's next report replaces its last one, it does not add to it.
    inflight.apply_peer("r2", {"w2": 4}, now_s=1.1)
    assert dict(inflight.counts) == {"w1": 2, "w2": 4}
    assert inflight.peers() == {"r2": 4} and inflight.peer_ids() == ["r2"]


def test_finishing_never_goes_below_zero_nor_eats_peers_counts() -> None:
    inflight = InFlight()
    inflight.apply_peer("r2", {"w1": 2}, now_s=0.0)
    inflight.finished("w1")  # not ours: a stray finish changes nothing
    assert inflight.of("w1") == 2
    inflight.started("w1")
    inflight.finished("w1")
    inflight.finished("w1")
    assert (inflight.of("w1"), inflight.own_of("w1")) == (2, 0)


def test_silent_and_departed_peers_stop_counting() -> None:
    inflight = InFlight()
    inflight.started("w1")
    inflight.apply_peer("old", {"w1": 5}, now_s=1.0)
    inflight.apply_peer("new", {"w1": 1}, now_s=3.0)
    assert inflight.expire_peers(older_than_s=2.0) == ["old"]
    assert inflight.of("w1") == 2
    inflight.forget_peer("new")
    inflight.forget_peer("never-seen")
    assert dict(inflight.counts) == {"w1": 1}
    assert inflight.peers() == {}


def test_a_peers_batch_lines_are_reported_kept_and_forgotten_with_it() -> None:
    # A report says how many of a replica's open requests per worker are Batch API lines
    # (never more than it has open there: a claim past that is sent as that much).
    report = decode_report_from(encode_report("r2", {"w1": 3, "w2": 1}, batch={
        "w1": 2, "w2": 5, "w3": 1}), {})
    assert report.batch == {"w1": 2, "w2": 1}
    assert decode_report_from(encode_report("r2", {"w1": 3}), {}).batch == {}  # none, or
    # a replica from before reports carried them: its lines count as interactive load
    inflight = InFlight()
    inflight.apply_peer("r2", report.open, 1.0, batch=report.batch)
    inflight.apply_peer("r3", {"w1": 4}, 1.0, batch={"w1": 4})
    assert inflight.peer_batch == {"w1": 6, "w2": 1}
    inflight.apply_peer("r2", {"w1": 1}, 1.1, batch={})  # its lines ended
    assert inflight.peer_batch == {"w1": 4}
    inflight.forget_peer("r3")
    assert inflight.peer_batch == {} and dict(inflight.counts) == {"w1": 1}


def test_a_peer_that_holds_batch_lines_is_known_to_until_it_holds_none() -> None:
    # The models a replica holds Batch API lines for travel with its reports, even when
    # it has nothing open (the peers' lines fill the room it waits for: batch_room).
    report = decode_report_from(encode_report("r2", {}, batch_ready=frozenset({"m", "n"})), {})
    assert report.batch_ready == {"m", "n"} and report.open == {}
    assert decode_report_from(encode_report("r2", {"w": 1}), {}).batch_ready == frozenset()
    # More models than a report may name are not said at all (the peers keep their room).
    many = frozenset(f"m{i}" for i in range(MAX_READY_MODELS + 1))
    assert decode_report_from(encode_report("r2", {}, batch_ready=many), {}).batch_ready == set()
    exchange = PeerExchange(redis=None, pubsub_redis=None, channel="c",  # type: ignore[arg-type]
                            inflight=(inflight := InFlight()), interval_s=lambda: 0.05)
    exchange._apply(encode_report("r2", {}, batch_ready=frozenset({"m"})))
    assert inflight.peer_ready == {"r2": {"m"}} and inflight.peer_ids() == ["r2"]
    exchange._apply(encode_report("r2", {"w": 1}))  # its lines all started or ended
    assert inflight.peer_ready == {}
    exchange._apply(encode_report("r2", {}, batch_ready=frozenset({"m"})))
    inflight.forget_peer("r2")  # gone silent
    assert inflight.peer_ready == {} and inflight.peer_ids() == []


def test_reports_round_trip_signed_and_unsigned() -> None:
    counts = {"us-east-1": 3, "eu:w@2": 1}
    assert decode_report(encode_report("r1", counts), {}) == ("r1", counts)
    signed = encode_report("r1", counts, ("k2", KEYS["k2"]))
    assert decode_report(signed, KEYS) == ("r1", counts)
    assert decode_report(signed, {}) == ("r1", counts)  # no keys here: signatures unchecked


@pytest.mark.parametrize(("payload", "reason"), [
    (encode_report("r1", {"w": 1}), "unsigned"),
    (encode_report("r1", {"w": 1}, ("k9", b"0123456789abcdef0123")), "unknown key id"),
    (encode_report("r1", {"w": 1}, ("k1", b"not-the-real-secret!")), "bad signature"),
    (encode_report("r1", {"w": 1}, ("k1", KEYS["k1"])).replace(b'"w":1', b'"w":9'),
     "bad signature"),
])
def test_with_keys_only_verified_reports_are_believed(payload: bytes, reason: str) -> None:
    with pytest.raises(ReportError, match=reason) as caught:
        decode_report(payload, KEYS)
    assert caught.value.reason == reason.replace(" id", "").replace(" ", "_")


@pytest.mark.parametrize(("payload", "reason"), [
    (b"", "not a v1 report"),
    (b"v2 - - {}", "not a v1 report"),
    (b"v1 - - {nope", "not JSON"),
    (b"v1 - - [1, 2]", "not an object"),
    (b'v1 - - {"open": {}}', "no router id"),
    (b'v1 - - {"router": "", "open": {}}', "no router id"),
    (b'v1 - - {"router": "r", "open": []}', "not {worker id: count}"),
    (b'v1 - - {"router": "r", "open": {"w": -1}}', "not {worker id: count}"),
    (b'v1 - - {"router": "r", "open": {"w": 1.5}}', "not {worker id: count}"),
    (b'v1 - - {"router": "r", "open": {"w": true}}', "not {worker id: count}"),
    (b'v1 - - {"router": "r", "open": {"w": %d}}' % (MAX_OPEN_PER_WORKER + 1),
     "not {worker id: count}"),
    (b"v1 - - " + b" " * MAX_REPORT_BYTES, "larger than"),
    (b'v1 - - {"router": "r", "open": {"w": 1}, "prefill": []}', "`prefill` is not"),
    (b'v1 - - {"router": "r", "open": {"w": 1}, "prefill": {"w": -5}}', "`prefill` is not"),
    (b'v1 - - {"router": "r", "open": {"w": 1}, "prefill": {"w": 2.5}}', "`prefill` is not"),
    (b'v1 - - {"router": "r", "open": {"w": 1}, "prefill": {"w": %d}}'
     % (MAX_PREFILL_PER_WORKER + 1), "`prefill` is not"),
    # prompts waiting on a worker where it has nothing open: a forgery, not a report
    (b'v1 - - {"router": "r", "open": {"w": 1}, "prefill": {"v": 10}}', "`prefill` is not"),
    # batch lines: at most the open requests on that worker, whole numbers
    (b'v1 - - {"router": "r", "open": {"w": 1}, "batch": {"w": 2}}', "`batch` is not"),
    (b'v1 - - {"router": "r", "open": {"w": 1}, "batch": {"v": 1}}', "`batch` is not"),
    (b'v1 - - {"router": "r", "open": {"w": 1}, "batch": {"w": -1}}', "`batch` is not"),
    (b'v1 - - {"router": "r", "open": {"w": 3}, "batch": {"w": 1.0}}', "`batch` is not"),
    (b'v1 - - {"router": "r", "open": {"w": 3}, "batch": [["w", 1]]}', "`batch` is not"),
    # the models it holds lines for: a short list of names
    (b'v1 - - {"router": "r", "open": {}, "batch_ready": "m"}', "`batch_ready` is not"),
    (b'v1 - - {"router": "r", "open": {}, "batch_ready": [1]}', "`batch_ready` is not"),
    (b'v1 - - {"router": "r", "open": {}, "batch_ready": [""]}', "`batch_ready` is not"),
    (b'v1 - - {"router": "r", "open": {}, "batch_ready": ["' + b"m" * 300 + b'"]}',
     "`batch_ready` is not"),
    (b'v1 - - {"router": "r", "open": {}, "batch_ready": ' + json.dumps(
        [f"m{i}" for i in range(40)]).encode() + b'}', "`batch_ready` is not"),
    *((b'v1 - - {"router": "r", "open": {}, "affinity": %s}' % affinity, "`affinity")
      for affinity in (
        b"[]", b'{"wrote": {}}', b'{"served": []}', b'{"wrote": {"w": -1}, "served": []}',
        b'{"wrote": {}, "served": {}}',
        b'{"wrote": {}, "served": [["w", [1], 5, 6]]}',  # not a triple
        b'{"wrote": {}, "served": [["", [1], 5]]}',  # no worker id
        b'{"wrote": {}, "served": [["%s", [1], 5]]}' % (b"w" * 257),
        b'{"wrote": {}, "served": [["w", [], 5]]}',  # no prefix key
        b'{"wrote": {}, "served": [["w", [4294967296], 5]]}',  # not a CRC-32
        b'{"wrote": {}, "served": [["w", [-1], 5]]}',
        b'{"wrote": {}, "served": [["w", [1.5], 5]]}',
        b'{"wrote": {}, "served": [["w", %s, 5]]}' % str(list(range(33))).encode(),
        b'{"wrote": {}, "served": [["w", [1], -5]]}',
        b'{"wrote": {}, "served": [["w", [1], true]]}',
        b'{"wrote": {}, "served": %s}' % (b"[" + b",".join([b'["w",[1],1]'] * 1001) + b"]"),
      )),
])
def test_malformed_reports_are_refused_with_a_reason(payload: bytes, reason: str) -> None:
    with pytest.raises(ReportError, match=reason):
        decode_report(payload, {})


def test_reports_of_large_fleets_are_spaced_to_bound_the_receivers_cpu() -> None:
    inflight = InFlight()
    exchange = PeerExchange(redis=None, pubsub_redis=None, channel="c",  # type: ignore[arg-type]
                            inflight=inflight, interval_s=lambda: 0.05)
    exchange._sent = {"w1": 1, "w2": 3}, {}, {}, frozenset()
    assert exchange._spacing_s(0.05) == 0.05  # small: as configured
    exchange._sent = ({f"w{i}": 1 for i in range(500)}, {f"w{i}": 80 for i in range(500)}, {},
                      frozenset())
    for peer in range(9):
        inflight.apply_peer(f"r{peer}", {"w1": 1}, now_s=0.0)
    # 10 replicas x 1,000 entries x 1 us each, at most 5 % of a core: every 0.2 s.
    assert exchange._spacing_s(0.05) == pytest.approx(0.2)
    for peer in range(9, 200):
        inflight.apply_peer(f"r{peer}", {"w1": 1}, now_s=0.0)
    assert exchange._spacing_s(0.05) == KEEPALIVE_S  # never so rare that peers expire it


def test_a_router_keeps_of_peer_reports_only_known_workers_and_so_many_senders(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Unsigned reports are believed: what a flood of them can make a router hold is
    bounded by the workers it knows and MAX_PEERS_COUNTED senders."""
    monkeypatch.setattr(peers_module, "MAX_PEERS_COUNTED", 3)
    inflight = InFlight()
    stats = SecurityStats()
    exchange = PeerExchange(redis=None, pubsub_redis=None, channel="c",  # type: ignore[arg-type]
                            inflight=inflight, interval_s=lambda: 0.05, stats=stats,
                            workers=lambda: {"w1", "w2"})
    for peer in range(5):
        exchange._apply(encode_report(f"r{peer}", {"w1": 1, "ghost": 7}))
    assert inflight.peers() == {"r0": 1, "r1": 1, "r2": 1}  # the ghost left out
    assert inflight.counts == {"w1": 3}
    assert stats.peer_reports_dropped["too_many_peers"] == 2
    exchange._apply(encode_report("r1", {"w1": 1, "ghost": 7}, batch={"w1": 1, "ghost": 7}))
    assert inflight.peer_batch == {"w1": 1}  # (its lines, known workers only)
    exchange._apply(encode_report("r0", {"ghost": 5}))  # a known sender, nothing known
    assert inflight.peers() == {"r1": 1, "r2": 1}
    exchange._apply(encode_report("r3", {"w2": 2}))  # room again
    assert inflight.counts == {"w1": 2, "w2": 2}


def test_own_requests_echo_for_siblings_for_two_report_intervals() -> None:
    inflight = InFlight()
    inflight.echo = 2  # two sibling replicas of this region heard lately
    inflight.started("w")
    assert (inflight.of("w"), inflight.own_of("w"), inflight.echoes()) == (3, 1, 2)
    inflight.roll_echo()  # the siblings' reports may not have come yet
    inflight.started("w")
    assert inflight.of("w") == 6
    inflight.roll_echo()  # the first request's echo ends; the second's lives one more
    assert inflight.of("w") == 4
    inflight.finished("w")
    inflight.roll_echo()
    assert (inflight.of("w"), inflight.echoes()) == (1, 0)
    inflight.finished("w")
    assert inflight.of("w") == 0 and inflight.counts == {}


def test_own_long_requests_are_counted_as_the_work_they_commit() -> None:
    inflight = InFlight()
    assert inflight.remaining_ms("w", 50.0, 10.0) == 0.0  # none said how long
    inflight.commit(attempt("w", 10.0), 600, 0, 10.0)
    inflight.commit(attempt("w", 11.0), 200, 0, 11.0)
    # 400 tokens on average at 50 ms a step, 0.5 s already run on average.
    assert inflight.remaining_ms("w", 50.0, 11.0) == pytest.approx(400 * 50.0 - 500.0)
    inflight.release("w", 600, 10.0)
    assert inflight.remaining_ms("w", 50.0, 12.0) == pytest.approx(200 * 50.0 - 1000.0)
    assert inflight.remaining_ms("w", 50.0, 100.0) == 0.0  # overdue: nothing left to price
    inflight.release("w", 200, 11.0)
    assert inflight.remaining_ms("w", 50.0, 12.0) == 0.0


def attempt(worker_id: str, started_s: float = 0.0, streamed: bool = True) -> Attempt:
    return Attempt(worker_id=worker_id, region="r", predicted_ttft_ms=0.0, reason="local",
                   started_s=started_s, streamed=streamed)


def test_prompts_count_as_prefill_ahead_until_their_first_byte_or_their_end() -> None:
    inflight = InFlight()
    first, second, third = attempt("w"), attempt("w"), attempt("v")
    inflight.commit(first, 0, 4000, 0.0)
    inflight.commit(second, 100, 1000, 0.0)
    inflight.commit(third, 0, 0, 0.0)  # all of its prompt in the prefix cache: none
    # a whole answer's first byte is its last: its prompt is not counted at all
    inflight.commit(attempt("v", streamed=False), 0, 9000, 0.0)
    assert inflight.prefilling == {"w": 5000}
    first.first_byte(1.0)
    assert inflight.prefilling == {"w": 1000} and first.first_byte_s == 1.0
    first.end_prefill()  # its end, after its first byte: counted once
    assert inflight.prefilling == {"w": 1000}
    second.end_prefill()  # ended before its first byte (failed, cancelled)
    second.first_byte(2.0)
    assert inflight.prefilling == {}


def test_peers_prompts_not_yet_prefilled_count_until_their_next_report() -> None:
    """A peer's report carries its prompt tokens not yet prefilled per worker; they add to
    this router's own, the next report replaces them, and a peer that left or went silent
    takes them along. An older replica's report (no `prefill`) adds none."""
    inflight = InFlight()
    own = attempt("w1")
    inflight.commit(own, 0, 1000, 0.0)
    report = encode_report("r2", {"w1": 2, "w2": 1}, prefill={"w1": 5000})
    peer, open_, _, prefill, *_ = decode_report_from(report, {})
    inflight.apply_peer(peer, open_, 1.0, prefill)
    assert inflight.prefilling == {"w1": 6000} and inflight.own_prefill() == {"w1": 1000}
    inflight.apply_peer("r2", {"w1": 2, "w2": 1}, 1.05, {"w2": 300})
    assert inflight.prefilling == {"w1": 1000, "w2": 300}
    older = decode_report_from(encode_report("r3", {"w2": 4}), {})
    assert older.prefill == {}
    inflight.apply_peer("r3", older.open, 1.1, older.prefill)
    own.first_byte(1.2)
    inflight.forget_peer("r2")
    assert inflight.prefilling == {} and inflight.own_prefill() == {}


def test_what_a_replica_sent_reaches_its_peers_tables() -> None:
    """A replica's sends since its last report (router.policy.affinity `take_shared`)
    travel in its report, and a peer takes them as its own: it finds the worker that holds
    a prompt prefix, and that worker's holders age by the tokens the sender wrote there."""
    sender, peer = AffinityTable(), AffinityTable()
    sender.shared = SharedSends()
    sender.sent("w1", 1000, session_id="s", prefix_keys=(11, 12), prompt_tokens=600,
                cached_tokens=0, completion_tokens=10)
    sender.sent("w2", 1000, session_id=None, prefix_keys=(), prompt_tokens=50,
                cached_tokens=0, completion_tokens=10)
    shared = sender.take_shared()
    assert sender.take_shared() is None  # taken once
    report = encode_report("r2", {}, affinity=shared)
    received = decode_report_from(report, {}).shared
    assert received is not None
    peer.apply_peer(received)
    assert peer.lookup(None, (11, 12)) == {"w1": 512}
    assert peer.lookup("s", ()) == {}  # sessions stay with their replica
    peer.wrote("w1", 1000, 1000)  # as much as w1's cache holds, since: still there
    assert peer.lookup(None, (11, 12)) == {"w1": 512}
    peer.wrote("w1", 1, 1000)  # more: evicted by now
    assert peer.lookup(None, (11, 12)) == {}
    older = decode_report_from(encode_report("r3", {"w1": 1}), {})
    assert older.shared is None  # a replica from before: nothing shared


def test_a_replica_keeps_at_most_a_bounded_batch_of_sends_for_its_peers() -> None:
    table = AffinityTable()
    table.shared = SharedSends()
    for number in range(MAX_SHARED_SERVED + 10):
        table.sent("w", 10**6, session_id=None, prefix_keys=(number,), prompt_tokens=300,
                   cached_tokens=0, completion_tokens=None)
    shared = table.take_shared()
    assert shared is not None and len(shared.served) == MAX_SHARED_SERVED
    assert shared.wrote == {"w": 10 * 300}  # the rest still age the worker's holders
    assert len(encode_report("r", {}, affinity=shared)) < MAX_REPORT_BYTES


def test_an_absurd_max_tokens_cannot_get_the_peer_reports_refused() -> None:
    # A client's max_tokens of 10**12 (the engine refuses the request; the router has
    # counted it as sent to the worker's cache): the report still goes through, counting
    # at most what peers believe, where every peer refused the whole report before.
    table = AffinityTable()
    table.shared = SharedSends()
    for _ in range(3):
        table.sent("w1", 1_000, session_id=None, prefix_keys=(7,), prompt_tokens=10,
                   cached_tokens=0, completion_tokens=10**12)
        table.sent("w2", 1_000, session_id=None, prefix_keys=(), prompt_tokens=10,
                   cached_tokens=0, completion_tokens=10**12)
    shared = table.take_shared()
    assert shared is not None
    report = decode_report_from(encode_report("r1", {"w1": 1}, affinity=shared), {})
    assert report.shared is not None
    assert report.shared.wrote == {"w2": MAX_WROTE_PER_WORKER}
    assert [tokens for _, _, tokens in report.shared.served] == [MAX_WROTE_PER_WORKER] * 3


def test_open_and_prefill_figures_are_sent_as_much_as_peers_believe() -> None:
    # 10**9 prompt tokens waiting on one worker (a client's absurd prompts, counted as
    # sent): sent as the most a peer believes, not as a report every peer refuses.
    report = decode_report_from(encode_report(
        "r1", {"w1": MAX_OPEN_PER_WORKER + 5, "w2": 1},
        prefill={"w1": 10**9, "w2": 10}), {})
    assert report.open == {"w1": MAX_OPEN_PER_WORKER, "w2": 1}
    assert report.prefill == {"w1": MAX_PREFILL_PER_WORKER, "w2": 10}
