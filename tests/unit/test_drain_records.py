"""Drain flags as Redis keeps them (router.registry.drains): signed with the heartbeat
keys, and read back only when signed, for the target they name."""

from __future__ import annotations

import json
import math

from router.registry.drains import DrainRecord

KEYS = {"k1": b"0123456789abcdef0123", "k2": b"fedcba9876543210fedc"}


def test_a_signed_flag_reads_back_and_an_unsigned_one_only_without_keys() -> None:
    record = DrainRecord("region", "us-east", 1_700_000_000.5, "maintenance", "ops")
    signed = record.to_json(("k2", KEYS["k2"]))
    assert DrainRecord.from_json("region:us-east", signed, KEYS) == record
    assert DrainRecord.from_json("region:us-east", record.to_json()) == record
    assert DrainRecord.from_json("region:us-east", record.to_json(), KEYS) is None


def test_a_signature_is_not_moved_to_another_target_nor_kept_through_an_edit() -> None:
    signed = DrainRecord("region", "us-east", 1.0, "", "ops").to_json(("k1", KEYS["k1"]))
    # the same bytes under another field: another region drained with its signature
    assert DrainRecord.from_json("region:eu-west", signed, KEYS) is None
    edited = json.loads(signed)
    edited["reason"] = "forged"
    assert DrainRecord.from_json("region:us-east", json.dumps(edited), KEYS) is None
    edited = json.loads(signed)
    edited["key_id"] = "k2"
    assert DrainRecord.from_json("region:us-east", json.dumps(edited), KEYS) is None


def test_odd_payloads_are_a_drain_without_details_never_an_exception() -> None:
    for payload in ("[" * 100_000, "not json", "[]", '{"since_unix_s": NaN}',
                    '{"since_unix_s": 1e999}', '{"since_unix_s": "yesterday"}'):
        record = DrainRecord.from_json("worker:w1", payload)
        assert record is not None and record.name == "w1"
        assert math.isfinite(record.since_unix_s)
