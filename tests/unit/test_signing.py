"""Signed heartbeats: signing, verification, key parsing and the router's heartbeat gate."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from router.admission.setup import heartbeat_gate
from router.auth.endpoints import EndpointAllowList
from router.config import GlobalConfig
from router.config_loader import parse_config
from router.core.stats import SecurityStats
from router.registry.heartbeat_gate import HeartbeatGate, HeartbeatRules
from worker.schema import Capacity, Heartbeat, LifecycleState, Load
from worker.signing import (
    HeartbeatSigner,
    SigningKeyError,
    canonical_bytes,
    keys_from_environ,
    parse_keys,
    verify_payload,
    verify_signature,
)

SECRET_1 = b"first-secret-0123456789"
SECRET_2 = b"second-secret-0123456789"
KEYS = {"k1": SECRET_1, "k2": SECRET_2}
NOW = 1_700_000_000.0


def heartbeat(**changes: object) -> Heartbeat:
    fields: dict[str, object] = {
        "worker_id": "w1", "region": "us-east", "endpoint": "http://10.0.0.5:8000",
        "models": ("m",), "state": LifecycleState.READY,
        "capacity": Capacity(max_num_seqs=8),
        "load": Load(running=0, waiting=0, kv_cache_usage=0.0),
        "seq": 7, "sent_at_s": NOW, "ttl_s": 2.0,
    }
    return Heartbeat.model_validate({**fields, **changes})


def test_a_signed_heartbeat_survives_the_trip_through_json() -> None:
    signed = HeartbeatSigner("k1", SECRET_1).sign(heartbeat())
    assert signed.key_id == "k1" and signed.signature is not None
    received = Heartbeat.from_json(signed.to_json())
    assert verify_signature(received, KEYS) is None


def test_a_published_payload_is_verified_on_its_bytes_and_old_payloads_still_verify() -> None:
    signer = HeartbeatSigner("k1", SECRET_1)
    signed, payload = signer.signed_payload(heartbeat())
    received = Heartbeat.from_json(payload)
    assert received == signed == signer.sign(heartbeat())  # the same signed heartbeat
    assert payload.startswith(canonical_bytes(signed)[:-1])
    assert verify_payload(payload, received, KEYS) is None
    assert verify_signature(received, KEYS) is None  # routers of before verify it too
    # What agents published before (the heartbeat serialized its own way) still verifies.
    old = signed.to_json().encode()
    assert old != payload and verify_payload(old, Heartbeat.from_json(old), KEYS) is None
    assert verify_payload(payload, received, {"k2": SECRET_2}) == "unknown_key"
    # Bytes changed anywhere, before the signature or after it, do not verify.
    for forged in (payload.replace(b'"seq":7', b'"seq":8'),
                   payload.replace(b'"region":"us-east"', b'"region":"eu-west"'),
                   payload[:-1] + b',"seq":8}',
                   payload.replace(b'"signature":"', b'"seq":8,"signature":"')):
        parsed = Heartbeat.from_json(forged)
        assert verify_payload(forged, parsed, KEYS) == "bad_signature", forged


@pytest.mark.parametrize("change", [
    {"endpoint": "http://203.0.113.9:8000"}, {"region": "eu-west"}, {"seq": 8},
    {"sent_at_s": NOW + 1}, {"state": LifecycleState.DRAINING}, {"key_id": "k2"},
    {"load": Load(running=0, waiting=0, kv_cache_usage=0.5)},
])
def test_any_change_breaks_the_signature(change: dict[str, object]) -> None:
    signed = HeartbeatSigner("k1", SECRET_1).sign(heartbeat())
    tampered = signed.model_copy(update=change)
    assert verify_signature(tampered, KEYS) == "bad_signature"


def test_unsigned_unknown_key_and_wrong_secret_are_told_apart() -> None:
    assert verify_signature(heartbeat(), KEYS) == "unsigned"
    other = HeartbeatSigner("k9", SECRET_1).sign(heartbeat())
    assert verify_signature(other, KEYS) == "unknown_key"
    forged = HeartbeatSigner("k1", b"not-the-real-secret!!").sign(heartbeat())
    assert verify_signature(forged, KEYS) == "bad_signature"


def test_two_keys_are_valid_at_once_for_rotation() -> None:
    for key_id, secret in KEYS.items():
        assert verify_signature(HeartbeatSigner(key_id, secret).sign(heartbeat()), KEYS) is None
    assert verify_signature(HeartbeatSigner("k1", SECRET_1).sign(heartbeat()),
                            {"k2": SECRET_2}) == "unknown_key"


def test_the_canonical_form_leaves_out_only_the_signature() -> None:
    signed = HeartbeatSigner("k1", SECRET_1).sign(heartbeat())
    text = canonical_bytes(signed).decode()
    assert '"key_id":"k1"' in text and "signature" not in text
    assert canonical_bytes(signed) == canonical_bytes(signed.model_copy(update={"signature": "ab"}))


def test_key_parsing_and_errors_never_show_a_secret(tmp_path: Path) -> None:
    assert parse_keys("k1:first-secret-0123456789, k2:second-secret-0123456789") == KEYS
    for bad in ("k1", "k1:short", ":first-secret-0123456789", "k 1:first-secret-0123456789",
                "k1:first-secret-0123456789,k1:second-secret-0123456789"):
        with pytest.raises(SigningKeyError) as caught:
            parse_keys(bad)
        assert "secret-0123456789" not in str(caught.value)
    path = tmp_path / "keys"
    path.write_text("# rotated 2026-11\nk1:first-secret-0123456789\n")
    environ = {"GLOBALPOOL_HEARTBEAT_KEYS_FILE": str(path),
               "GLOBALPOOL_HEARTBEAT_KEYS": "k2:second-secret-0123456789"}
    assert keys_from_environ(environ) == KEYS
    assert keys_from_environ({}) == {}


def test_the_signer_comes_from_the_environment() -> None:
    environ = {"GLOBALPOOL_HEARTBEAT_KEYS": "k1:first-secret-0123456789,"
                                            "k2:second-secret-0123456789"}
    assert HeartbeatSigner.from_environ({}) is None
    first = HeartbeatSigner.from_environ(environ)
    assert first is not None and first.key_id == "k1"
    chosen = HeartbeatSigner.from_environ({**environ, "GLOBALPOOL_HEARTBEAT_KEY_ID": "k2"})
    assert chosen is not None and chosen.key_id == "k2"
    assert "secret" not in repr(chosen)
    with pytest.raises(SigningKeyError, match="'k3' is not among"):
        HeartbeatSigner.from_environ(environ, "k3")
    with pytest.raises(SigningKeyError, match="no keys are set"):
        HeartbeatSigner.from_environ({}, "k1")


def test_the_schema_accepts_old_unsigned_heartbeats_and_rejects_odd_signatures() -> None:
    assert heartbeat().signature is None
    with pytest.raises(ValidationError):
        heartbeat(signature="not hex!")
    with pytest.raises(ValidationError):
        heartbeat(key_id="a b")


def gate(keys: dict[str, bytes] | None = None, *, now: float = NOW,
         allow: dict[str, list[str]] | None = None) -> tuple[HeartbeatGate, SecurityStats]:
    stats = SecurityStats()
    rules = HeartbeatRules(
        allow_lists={r: EndpointAllowList.parse(e) for r, e in (allow or {}).items()},
        known_regions=frozenset({"us-east", "eu-west"}), max_clock_skew_s=5.0)
    return HeartbeatGate(keys=KEYS if keys is None else keys, rules=lambda: rules,
                         stats=stats, clock=lambda: now), stats


def signed(**changes: object) -> Heartbeat:
    return HeartbeatSigner("k2", SECRET_2).sign(heartbeat(**changes))


def test_the_gate_drops_unsigned_forged_future_and_expired_heartbeats() -> None:
    check, stats = gate()
    assert check.check(signed(), via_pubsub=True) is None
    assert check.check(heartbeat(), via_pubsub=True) == "unsigned"
    assert check.check(signed().model_copy(update={"endpoint": "http://6.6.6.6:80"}),
                       via_pubsub=False) == "bad_signature"
    assert check.check(signed(sent_at_s=NOW + 60), via_pubsub=True) == "future"
    assert check.check(signed(sent_at_s=NOW - 60), via_pubsub=False) == "expired"
    assert check.check(signed(sent_at_s=NOW + 4), via_pubsub=True) is None  # within the skew
    assert stats.heartbeats_dropped == {"unsigned": 1, "bad_signature": 1, "future": 1,
                                        "expired": 1}
    assert stats.heartbeats_verified == 2


def test_the_gate_drops_replays_but_not_a_restarted_worker() -> None:
    check, stats = gate()
    assert check.check(signed(seq=10, sent_at_s=NOW - 1), via_pubsub=True) is None
    assert check.check(signed(seq=11, sent_at_s=NOW - 0.5), via_pubsub=True) is None
    assert check.check(signed(seq=10, sent_at_s=NOW - 1), via_pubsub=True) == "replayed"
    # The same report read again from its key is not a replay (a full read repeats it).
    assert check.check(signed(seq=11, sent_at_s=NOW - 0.5), via_pubsub=False) is None
    # A restarted worker counts from 0 again, but later.
    assert check.check(signed(seq=0, sent_at_s=NOW), via_pubsub=True) is None
    assert stats.heartbeats_dropped == {"replayed": 1}


def test_without_keys_unsigned_heartbeats_are_accepted() -> None:
    check, stats = gate(keys={})
    assert check.check(heartbeat(), via_pubsub=True) is None
    assert check.check(heartbeat(sent_at_s=0.0), via_pubsub=True) is None
    assert not stats.heartbeats_dropped


def test_the_gate_drops_endpoints_outside_the_allow_list() -> None:
    check, stats = gate(keys={}, allow={"us-east": ["10.0.0.0/16", "*.us.internal"]})
    assert check.check(heartbeat(endpoint="http://10.0.9.9:8000"), via_pubsub=True) is None
    assert check.check(heartbeat(endpoint="https://gpu-1.us.internal"), via_pubsub=True) is None
    for outside in ("http://10.1.0.1:8000", "http://evil.example:80",
                    "http://gpu-1.us.internal@6.6.6.6:80", "http://us.internal.evil.example"):
        assert check.check(heartbeat(endpoint=outside), via_pubsub=True) == \
            "endpoint_not_allowed", outside
    # eu-west has no list: any endpoint; a region regions.yaml does not know: dropped.
    assert check.check(heartbeat(region="eu-west", endpoint="http://1.2.3.4"),
                       via_pubsub=True) is None
    assert check.check(heartbeat(region="mars"), via_pubsub=True) == "unknown_region"
    assert stats.heartbeats_dropped["endpoint_not_allowed"] == 4


@settings(max_examples=300, deadline=None)
@given(payload=st.one_of(
    st.binary(max_size=300),
    st.text(max_size=300),
    st.recursive(st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=20),
                 lambda children: st.lists(children, max_size=4)
                 | st.dictionaries(st.text(max_size=12), children, max_size=6),
                 max_leaves=30).map(lambda v: __import__("json").dumps(v)),
))
def test_garbage_never_gets_past_parsing_and_checking_without_a_clean_verdict(
    payload: bytes | str,
) -> None:
    check, _ = gate()
    try:
        parsed = Heartbeat.from_json(payload)
    except ValidationError:
        return
    assert check.check(parsed, via_pubsub=True) in (None, "unsigned", "unknown_key",
                                                    "bad_signature", "future", "expired",
                                                    "replayed")


@settings(max_examples=200, deadline=None)
@given(
    sent_at_s=st.floats(allow_nan=True, allow_infinity=True),
    seq=st.integers(min_value=0, max_value=2**63),
    ttl_s=st.floats(min_value=0.001, max_value=3600),
    endpoint=st.from_regex(r"https?://[^\s]{1,40}", fullmatch=True),
)
def test_signed_heartbeats_with_odd_values_verify_or_drop_cleanly(
    sent_at_s: float, seq: int, ttl_s: float, endpoint: str,
) -> None:
    check, _ = gate(now=time.time(), allow={"us-east": ["10.0.0.0/8"]})
    try:
        beat = heartbeat(sent_at_s=sent_at_s, seq=seq, ttl_s=ttl_s, endpoint=endpoint)
    except ValidationError:
        return
    try:
        candidate = HeartbeatSigner("k1", SECRET_1).sign(beat)
    except ValueError:  # NaN/inf cannot be signed
        candidate = beat
    assert check.check(candidate, via_pubsub=True) in (
        None, "unsigned", "future", "expired", "endpoint_not_allowed", "replayed")


def test_the_gate_follows_a_reloaded_config() -> None:
    def config(insecure: bool = True, **us_east: object) -> GlobalConfig:
        return parse_config({"apiVersion": "globalpool/v1",
                             "heartbeat": {"insecure": insecure}, "regions": {
                                 "us-east": {"models": ["m"], **us_east}}})

    current = [config()]
    gate_ = heartbeat_gate(lambda: current[0], {}, SecurityStats())
    assert gate_.check(heartbeat(), via_pubsub=True) is None  # a private address: allowed
    assert gate_.check(heartbeat(endpoint="http://203.0.113.7:8000"),
                       via_pubsub=True) == "endpoint_not_allowed"  # public: not by default
    assert gate_.check(heartbeat(models=("m", "other")), via_pubsub=True) == "model_not_listed"
    current[0] = config(allowed_endpoints=["192.0.2.0/24"])  # a hot reload adds a list
    assert gate_.check(heartbeat(), via_pubsub=True) == "endpoint_not_allowed"
    assert gate_.check(heartbeat(region="eu-west"), via_pubsub=True) == "unknown_region"
    current[0] = config(allowed_endpoints=["10.0.0.0/8"])
    assert gate_.check(heartbeat(), via_pubsub=True) is None
    current[0] = config(insecure=False)  # no keys and no opt-out: nothing is believed
    assert gate_.check(heartbeat(), via_pubsub=True) == "no_keys"
