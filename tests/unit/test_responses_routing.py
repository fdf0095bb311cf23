"""The Responses API's routing parts without a server: the body's fields, the response id
in an answer, the one worker a follow-up may go to, and the holder records on a real
Valkey (signed, owned, bounded, expiring)."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.core.errors import ApiError
from router.core.parse import parse_body
from router.policy import NoRoute, RouteRequest
from router.proxy.responses import id_in_body, id_in_first_event
from router.registry.drained import Drained
from router.registry.response_store import ResponseHolder, ResponseStats, ResponseStore
from tests.unit.test_policy import make_policy, snapshot, view
from worker.redis_client import connect
from worker.schema import LifecycleState

SECRET = b"0123456789abcdef0123"


def parse(document: object) -> object:
    return parse_body(json.dumps(document).encode(), "responses")


def test_a_create_is_parsed_for_routing() -> None:
    parsed = parse_body(json.dumps({
        "model": "m", "input": [{"role": "user", "content": "hello " * 400},
                                {"type": "message", "role": "user",
                                 "content": [{"type": "input_text", "text": "more"}]}],
        "instructions": "be brief", "max_output_tokens": 64, "stream": True,
        "previous_response_id": "resp_0123abc", "unknown": {"passed": "on"},
    }).encode(), "responses")
    assert (parsed.model, parsed.stream, parsed.store) == ("m", True, True)
    assert parsed.previous_response_id == "resp_0123abc"
    assert parsed.completion_tokens == 64
    assert parsed.prompt_tokens == (8 + 2400 + 4) // 4
    assert len(parsed.prefix_keys) == 2  # its first 1k and 2k characters
    text = parse_body(b'{"model": "m", "input": "hi", "store": false}', "responses")
    assert (text.store, text.previous_response_id, text.stream) == (False, None, False)


@pytest.mark.parametrize(("document", "param"), [
    ({"model": "m"}, "input"),
    ({"model": "m", "input": "x", "store": "yes"}, "store"),
    ({"model": "m", "input": "x", "previous_response_id": 7}, "previous_response_id"),
    ({"model": "m", "input": "x", "previous_response_id": "resp_x\r\nSET a b"},
     "previous_response_id"),
    ({"model": "m", "input": "x", "previous_response_id": "r" * 129}, "previous_response_id"),
    ({"model": "m", "input": "x", "previous_response_id": ""}, "previous_response_id"),
    ({"input": "x"}, "model"),
    ({"model": "m", "input": "x", "request_id": "resp_someone_elses"}, "request_id"),
])
def test_a_malformed_create_is_a_400_naming_the_field(document: object, param: str) -> None:
    with pytest.raises(ApiError) as refused:
        parse(document)
    assert (refused.value.status, refused.value.param) == (400, param)


@given(st.dictionaries(st.sampled_from(["model", "input", "instructions", "store",
                                        "previous_response_id", "max_output_tokens",
                                        "stream"]),
                       st.recursive(st.none() | st.booleans() | st.integers() | st.text(),
                                    lambda inner: st.lists(inner, max_size=3)
                                    | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                                    max_leaves=8)))
def test_any_body_is_parsed_or_refused_with_a_400(document: dict[str, object]) -> None:
    try:
        parsed = parse(document)
    except ApiError as refused:
        assert refused.status == 400
    else:
        assert parsed.prompt_tokens >= 1  # type: ignore[attr-defined]


def test_the_response_id_is_read_from_a_whole_answer_and_a_streams_first_event() -> None:
    assert id_in_body(b'{"id": "resp_abc", "object": "response"}') == "resp_abc"
    for body in (b"not json", b"[]", b'{"id": 3}', b'{"id": "resp_\\r\\n"}', b"{}"):
        assert id_in_body(body) is None
    first = (b'event: response.created\ndata: {"response": {"id": "resp_9f", "status": '
             b'"in_progress"}, "sequence_number": 0, "type": "response.created"}\n\n')
    assert id_in_first_event(first) == "resp_9f"
    assert id_in_first_event(first.replace(b"\n", b"\r\n")) == "resp_9f"
    assert id_in_first_event(b'data: {"type": "error"}\n\n') is None
    assert id_in_first_event(b"data: [DONE]\n\n") is None


def route(only: str, **kwargs: object) -> RouteRequest:
    return RouteRequest(model="m", origin_region="us-east", only_worker=only,
                        **kwargs)  # type: ignore[arg-type]


def test_a_follow_up_goes_to_its_holder_only_even_when_it_is_busy_or_draining() -> None:
    snap = snapshot(view("near"), view("holder", "eu-west", running=8, waiting=20))
    policy = make_policy()
    assert policy.pick(snap, route("holder")).worker.worker_id == "holder"
    drained = Drained(regions=frozenset({"eu-west"}), workers=frozenset())
    assert policy.pick(snap, route("holder", drained=drained)).worker.worker_id == "holder"
    draining = snapshot(view("holder", state=LifecycleState.DRAINING))
    assert policy.pick(draining, route("holder")).worker.worker_id == "holder"


@pytest.mark.parametrize(("case", "code"), [
    ("gone", "model_unavailable"),
    ("stale", "model_unavailable"),
    ("other model", "model_unavailable"),
    ("residency", "region_unavailable"),
    ("tried", "no_capacity"),
    ("starting", "no_capacity"),
])
def test_a_follow_up_whose_holder_cannot_take_it_is_never_sent_elsewhere(
        case: str, code: str) -> None:
    holder = view("holder", "eu-west",
                  received_at_s=90.0 if case == "stale" else 100.0,
                  models=("other",) if case == "other model" else ("m",),
                  state=LifecycleState.STARTING if case == "starting" else LifecycleState.READY)
    snap = snapshot(view("near"), *(() if case == "gone" else (holder,)))
    kwargs: dict[str, object] = {}
    if case == "residency":
        kwargs["allowed_regions"] = frozenset({"us-east"})
    if case == "tried":
        kwargs["exclude"] = frozenset({"holder"})
    with pytest.raises(NoRoute) as refused:
        make_policy().pick(snap, route("holder", **kwargs))
    assert refused.value.code == code
    assert "near" not in refused.value.reason and "127.0.0.1" not in refused.value.reason


HOLDER = ResponseHolder("w1", "eu-west", "m", "acme")


async def test_a_holder_recorded_by_one_replica_is_found_by_another_for_its_owner_only(
        redis_url: str, key_prefix: str) -> None:
    keys = {"k1": SECRET}
    one = ResponseStore(connect(redis_url), key_prefix, ttl_s=60, keys=keys)
    other = ResponseStore(connect(redis_url), key_prefix, ttl_s=60, keys=keys)
    await one.record("resp_1", HOLDER)
    assert await other.lookup("resp_1", "acme") == HOLDER
    assert await other.lookup("resp_1", "globex") is None
    assert await other.lookup("resp_unknown", "acme") is None
    assert other.stats.lookups == {"other_tenant": 1, "unknown": 1}
    assert one.stats.recorded == {"stored": 1}


async def test_a_record_written_by_someone_with_redis_access_is_not_believed(
        redis_url: str, key_prefix: str) -> None:
    store = ResponseStore(connect(redis_url), key_prefix, ttl_s=60, keys={"k1": SECRET})
    attacker = connect(redis_url)
    await store.record("resp_1", HOLDER)
    genuine = await attacker.get(store.key("resp_1"))
    assert isinstance(genuine, bytes)
    fields = json.loads(genuine)
    # moved to another worker, given to another tenant, copied under another id, unsigned,
    # signed with a key the router does not have, and not a record at all
    forged = [
        {**fields, "w": "attackers-worker"}, {**fields, "o": "globex"},
        {key: value for key, value in fields.items() if key not in "ks"},
        {**fields, "k": "k2"}, "[1, 2]", "x" * 5000, "\xff",
    ]
    await attacker.set(store.key("resp_copy"), genuine)
    for number, record in enumerate(forged):
        await attacker.set(store.key(f"resp_f{number}"),
                           record if isinstance(record, str) else json.dumps(record))
    reader = ResponseStore(connect(redis_url), key_prefix, ttl_s=60, keys={"k1": SECRET})
    for number in range(len(forged)):
        assert await reader.lookup(f"resp_f{number}", "acme") is None
        assert await reader.lookup(f"resp_f{number}", "globex") is None
    assert await reader.lookup("resp_copy", "acme") is None
    assert reader.stats.lookups["forged"] == 2 * len(forged) + 1
    assert await reader.lookup("resp_1", "acme") == HOLDER
    unsigned = ResponseStore(connect(redis_url), key_prefix, ttl_s=60, keys={})
    await unsigned.record("resp_u", HOLDER)
    assert await reader.lookup("resp_u", "acme") is None  # where heartbeats are signed


async def test_records_expire_and_a_replica_remembers_only_the_newest(
        redis_url: str, key_prefix: str) -> None:
    store = ResponseStore(connect(redis_url), key_prefix, ttl_s=0.3, keys={},
                          local_entries=2)
    for number in range(3):
        await store.record(f"resp_{number}", HOLDER)
    assert [key for key in store._local] == ["resp_1", "resp_2"]  # bounded
    other = ResponseStore(connect(redis_url), key_prefix, ttl_s=0.3, keys={})
    assert await other.lookup("resp_0", "acme") == HOLDER
    await asyncio.sleep(0.5)
    assert await other.lookup("resp_0", "acme") is None  # Redis expired it
    assert await store.lookup("resp_2", "acme") is None  # and so did the local memory


async def test_without_redis_a_replica_still_finds_its_own_and_says_it_cannot_look(
        key_prefix: str) -> None:
    from router.registry.response_store import StoreUnavailable
    dead = connect("redis://127.0.0.1:1", socket_timeout_s=0.2)
    stats = ResponseStats()
    store = ResponseStore(dead, key_prefix, ttl_s=60, keys={}, stats=stats)
    await store.record("resp_mine", HOLDER)  # never raises
    assert stats.recorded == {"local_only": 1}
    assert await store.lookup("resp_mine", "acme") == HOLDER
    with pytest.raises(StoreUnavailable):
        await store.lookup("resp_theirs", "acme")
    assert stats.lookups["store_unavailable"] == 1
