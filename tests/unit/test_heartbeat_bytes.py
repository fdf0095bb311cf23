"""What the collector reads from a heartbeat's bytes without parsing it (worker id, send
time, seq) agrees with the parsed heartbeat, in both forms agents publish."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from router.registry.messages import WORKER_ID_FIELD, _order_of
from worker.schema import Capacity, Heartbeat, LifecycleState, Load
from worker.signing import HeartbeatSigner

SIGNER = HeartbeatSigner("k1", b"a-test-secret-of-some-length")


@settings(max_examples=300, deadline=None)
@given(sent_at_s=st.floats(min_value=0.0, max_value=4e9, allow_nan=False),
       seq=st.integers(min_value=0, max_value=2**62),
       worker_id=st.from_regex(r"[A-Za-z0-9._:@-]{1,40}", fullmatch=True),
       metric_names=st.lists(st.sampled_from(
           ['vllm:num_seqs', 'seq', '"seq":1', 'sent_at_s', '}', ','])))
def test_order_and_worker_id_read_from_bytes_match_the_parsed_heartbeat(
        sent_at_s: float, seq: int, worker_id: str, metric_names: list[str]) -> None:
    heartbeat = Heartbeat.model_validate({
        "worker_id": worker_id, "region": "r", "endpoint": "http://10.0.0.1:8000",
        "models": ("m",), "state": LifecycleState.READY,
        "capacity": Capacity(max_num_seqs=8),
        "load": Load(running=1, waiting=0, kv_cache_usage=0.5),
        "engine": {"metric_names": metric_names},
        "seq": seq, "sent_at_s": sent_at_s, "ttl_s": 2.0})
    for payload in (heartbeat.to_json().encode(), SIGNER.signed_payload(heartbeat)[1]):
        parsed = Heartbeat.from_json(payload)
        assert _order_of(payload) == (parsed.sent_at_s, parsed.seq)
        start = payload.find(WORKER_ID_FIELD) + len(WORKER_ID_FIELD)
        assert payload[start:payload.find(b'"', start)].decode() == parsed.worker_id


def test_bytes_without_those_fields_give_no_order() -> None:
    assert _order_of(b'{"worker_id":"a"}') is None
    assert _order_of(b'{"seq":1,"sent_at_s":null}') is None
