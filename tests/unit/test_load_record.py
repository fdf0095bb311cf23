"""Load records: what agents write every heartbeat and routers apply onto a worker's view."""

from __future__ import annotations

import hashlib
import hmac
import json
import types

import pytest

from router.registry.worker_view import WorkerView
from worker.load_records import LoadRecord, load_record, record_items, static_digest
from worker.schema import Capacity, EngineInfo, Heartbeat, LifecycleState, Load, Performance
from worker.signing import HeartbeatSigner, Verdict, hmac_sha256_hex, verify_record

SECRET = b"a-test-secret-of-at-least-32-bytes!!"


def view_fields() -> list[str]:
    """Every attribute a view has: its slots (pure build), or the compiled class's
    attribute descriptors (mypyc keeps no `__slots__`; `static_digest` is one as well)."""
    names = [name for name, attribute in vars(WorkerView).items()
             if isinstance(attribute, types.GetSetDescriptorType | types.MemberDescriptorType)]
    assert len(names) >= 27, names
    return names


def beat(**changes: object) -> Heartbeat:
    heartbeat = Heartbeat(
        worker_id="w-1", region="us-east", endpoint="http://127.0.0.1:1", models=("m",),
        state=LifecycleState.READY, capacity=Capacity(max_num_seqs=8),
        load=Load(running=3, waiting=1, kv_cache_usage=0.95),
        performance=Performance(ttft_ms=120.0, itl_ms=21.5, e2e_ms=800.0,
                                prefill_tokens_per_s=5000.0, decode_tokens_per_s=300.0),
        seq=7, sent_at_s=1_764_500_000.25, ttl_s=2.0)
    return heartbeat.model_copy(update=changes)


def parsed(payload: bytes) -> LoadRecord:
    return LoadRecord.from_json(payload)


def test_a_record_carries_the_order_and_load_of_its_heartbeat() -> None:
    heartbeat = beat()
    record = parsed(load_record(heartbeat))
    assert record == LoadRecord("w-1", 7, 1_764_500_000.25, static_digest(heartbeat), 3, 1,
                                0.95, 120.0, 21.5, 800.0, 5000.0, 300.0, None, None)
    quiet = parsed(load_record(beat(load=Load(running=0, waiting=0, kv_cache_usage=None),
                                    performance=Performance())))
    assert quiet[6:12] == (None,) * 6


def test_the_digest_changes_with_anything_but_order_and_load() -> None:
    digest = static_digest(beat())
    assert static_digest(beat(seq=8, sent_at_s=2.0, load=Load(running=0, waiting=0,
                                                              kv_cache_usage=0.0),
                              performance=Performance())) == digest
    for changes in ({"state": LifecycleState.DRAINING}, {"models": ("m", "n")},
                    {"lora_adapters": ("a",)}, {"endpoint": "http://127.0.0.1:2"},
                    {"capacity": Capacity(max_num_seqs=16)}, {"ttl_s": 3.0},
                    {"engine": EngineInfo(version="0.32.0")}, {"key_id": "k2"},
                    {"region": "eu-west"}, {"worker_id": "w-2"}):
        assert static_digest(beat(**changes)) != digest, changes


@pytest.mark.parametrize(("fields", "message"), [
    ({"x": 1}, "load record: Input should be a valid array"),
    ([1, "w"], "seq: Field required"),
    ([2, "w", 1, 1.0, 1, 0, 0, None, None, None, None, None, None], "version: Input should be 1"),
    ([1, "", 1, 1.0, 1, 0, 0, None, None, None, None, None, None], "worker_id: String should"),
    ([1, "w", -1, 1.0, 1, 0, 0, None, None, None, None, None, None], "seq: Input should be"),
    ([1, "w", 1, 1.0, 1, True, 0, None, None, None, None, None, None], "running: Input should"),
    ([1, "w", 1, 1.0, 1, 0, 2.5, None, None, None, None, None, None], "waiting: Input should"),
    ([1, "w", 1, "now", 1, 0, 0, None, None, None, None, None, None], "sent_at_s: Input should"),
    ([1, "w", 1, 1.0, 1, 0, 0, 1.5, None, None, None, None, None], "kv_cache_usage: Input"),
    ([1, "w", 1, 1.0, 1, 0, 0, None, -3.0, None, None, None, None], "ttft_ms: Input should"),
    ([1, "w", 1, 1.0, 1, 0, 0, None, None, None, None, "fast", None], "prefill_tokens_per_s"),
    ([1, "w", 1, 1.0, 1, 0, 0, None, None, None, None, None, None, 5, "ab"], "key_id: Input"),
    ([1, "w", 1, 1.0, 1, 0, 0, None, None, None, None, None, None, 1], "load record: Tuple"),
    # Strings a heartbeat could not carry either (and compare_digest would raise on).
    ([1, "w\u00e9", 1, 1.0, 1, 0, 0, None, None, None, None, None, None], "worker_id: String"),
    ([1, "w\ud800", 1, 1.0, 1, 0, 0, None, None, None, None, None, None], "load record: Invalid"),
    ([1, "w", 1, 1.0, 1, 0, 0, None, None, None, None, None, None, "k1", "\u00e9" * 64],
     "signature: String should match"),
    ([1, "w", 1, 1.0, 1, 0, 0, None, None, None, None, None, None, "k 1", "ab"],
     "key_id: String should match"),
])
def test_a_malformed_record_is_refused_with_a_reason(fields: object, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{message}"):
        LoadRecord.from_json(json.dumps(fields).encode())


def test_out_of_range_numbers_are_refused() -> None:
    # What JSON parsers accept but a heartbeat cannot carry: infinity (1e999) and NaN.
    with pytest.raises(ValueError, match="sent_at_s: Input should be a finite number"):
        parsed(b'[1,"w",1,1e999,1,0,0,null,null,null,null,null,null]')
    with pytest.raises(ValueError, match="ttft_ms: Input should be a finite number"):
        parsed(b'[1,"w",1,1.0,1,0,0,null,NaN,null,null,null,null]')
    with pytest.raises(ValueError, match="load record: Invalid JSON"):
        parsed(b'[1,"w",1,1.0,1,0,0')


def test_a_signed_record_verifies_and_any_change_breaks_it() -> None:
    signer = HeartbeatSigner("k1", SECRET)
    keys = {"k1": SECRET}
    payload = signer.signed_record(load_record(beat()))
    record = parsed(payload)
    assert (record.key_id, len(record.signature or "")) == ("k1", 64)
    assert verify_record(payload, record, keys) is None
    assert verify_record(payload, record, {"k2": SECRET}) == Verdict.UNKNOWN_KEY
    unsigned = load_record(beat())
    assert verify_record(unsigned, parsed(unsigned), keys) == Verdict.UNSIGNED
    more_load = payload.replace(b',3,1,0.95,', b',0,0,0.95,')
    assert more_load != payload
    assert verify_record(more_load, parsed(more_load), keys) == Verdict.BAD_SIGNATURE
    other_key = payload.replace(b'"k1"', b'"k2"')
    assert verify_record(other_key, parsed(other_key), {"k1": SECRET, "k2": SECRET}) \
        == Verdict.BAD_SIGNATURE
    # The same items written otherwise (spaces) are not the bytes that were signed.
    respaced = json.dumps(json.loads(payload)).encode()
    assert verify_record(respaced, parsed(respaced), keys) == Verdict.BAD_SIGNATURE


def test_a_view_takes_a_newer_records_load_and_keeps_its_heartbeat() -> None:
    heartbeat = beat(load=Load(running=0, waiting=0, kv_cache_usage=0.1))
    view = WorkerView(heartbeat, received_at_s=100.0, inflight_at_receipt=2)
    record = record_items(load_record(beat(seq=8, sent_at_s=1_764_500_000.5)))
    newer = view.with_load(record, 101.0, 5)
    assert newer.heartbeat is heartbeat and newer.static_digest == view.static_digest
    assert (newer.seq, newer.sent_at_s, newer.running, newer.waiting) == (
        8, 1_764_500_000.5, 3, 1)
    assert newer.newer_than(view) and not view.newer_than(newer)
    assert (newer.received_at_s, newer.inflight_at_receipt, newer.expires_at_s) == (
        101.0, 5, 103.0)
    # The scoring terms follow the record, as they would a full heartbeat with that load.
    full = WorkerView(beat(seq=8, sent_at_s=1_764_500_000.5), 101.0, 5)
    for name in ("reported_load", "slots", "queue_ms_per_request", "kv_pressure_ms",
                 "prefill_ms_per_token", "kv_cache_usage", "ttft_ms", "e2e_ms", "first_step_ms",
                 "engine_ms"):
        assert getattr(newer, name) == getattr(full, name), name
    assert newer.kv_pressure_ms == pytest.approx(0.5 * 800.0)
    # The view it came from is unchanged.
    assert (view.running, view.seq, view.received_at_s) == (0, 7, 100.0)
    # Records read so rarely that the next read may come later than the TTL (2 s here):
    # fresh until that read could take the agent's next record.
    assert view.with_load(record, 101.0, 5, next_read_s=1.0).expires_at_s == 103.0
    assert view.with_load(record, 101.0, 5, next_read_s=2.5).expires_at_s == 103.5
    assert WorkerView(heartbeat, 101.0, 5, next_read_s=2.5).expires_at_s == 103.5
    assert view.received_again(150.0, next_read_s=2.5).expires_at_s == 152.5
    again = newer.received_again(150.0)
    assert (again.received_at_s, again.expires_at_s, again.running, again.seq) == (
        150.0, 152.0, 3, 8)
    assert {name: getattr(again, name) for name in view_fields()
            if name not in ("received_at_s", "expires_at_s")} == {
        name: getattr(newer, name) for name in view_fields()
        if name not in ("received_at_s", "expires_at_s")}
    # A signed record's items (key id and signature after the load) make the same view.
    signed = record_items(HeartbeatSigner("k1", SECRET).signed_record(
        load_record(beat(seq=8, sent_at_s=1_764_500_000.5))))
    assert len(signed) == len(record) + 2 and LoadRecord.of(signed).key_id == "k1"
    from_signed = view.with_load(signed, 101.0, 5)
    for name in view_fields():
        assert getattr(from_signed, name) == getattr(newer, name), name


def test_record_items_are_the_arrays_items_and_a_load_record_names_them() -> None:
    payload = load_record(beat())
    items = record_items(payload)
    assert items == tuple(json.loads(payload))
    assert LoadRecord.of(items) == LoadRecord.from_json(payload) == LoadRecord(*items[1:])


@pytest.mark.parametrize("secret", [b"k" * 16, b"s" * 64, b"long" * 40, bytes(range(256))])
def test_the_prepared_hmac_is_hmac_sha256(secret: bytes) -> None:
    for message in (b"", b"x", bytes(range(256)) * 3):
        assert hmac_sha256_hex(secret, message) == \
            hmac.new(secret, message, hashlib.sha256).hexdigest()
