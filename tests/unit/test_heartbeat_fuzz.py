"""Hostile heartbeats and load records, generated, through the real schema, the views and
snapshots the collector makes of what it takes, and the predicted-TTFT policy.

Each input is either refused with the reason the spec below gives (the reasons the collector
counts, router.registry.collector) or taken; routing over what was taken never raises and
scores every worker with a finite number. The agent's side: odd engine metrics (NaN and
infinities are legal Prometheus text) never make a heartbeat that cannot be published.

The spec is written here from the limits the project promises (finite, typed, counts
0..10,000,000, latencies 0..86,400,000 ms, rates 0..1e12 tokens/s, ...), not read from
worker.schema: a limit that drifts fails these tests. The counts of inputs are printed
(`pytest -s`) for the README.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pydantic_core
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.policy import NoRoute, RouteRequest
from router.registry.refusals import REFUSAL_REASONS
from router.registry.snapshot import Snapshot
from router.registry.worker_view import WorkerView
from tests.unit.test_policy import make_policy, view
from worker.engine_metrics import MetricsFormatError, parse_metrics
from worker.engine_performance import PerformanceTracker
from worker.heartbeat import EngineView, WorkerIdentity, build_heartbeat
from worker.load_records import load_record, record_items
from worker.probe import EngineVersion, ServedModels, parse_models, parse_version
from worker.schema import (
    Capacity,
    EngineInfo,
    Heartbeat,
    LifecycleState,
    Load,
    Performance,
    Refused,
    parse_heartbeat,
)
from worker.signing import HeartbeatSigner, canonical_bytes

# --- the spec ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Num:
    """A JSON number of `kind` in low..high (low excluded when `above_low`)."""

    kind: type
    low: float
    high: float
    nullable: bool = False
    above_low: bool = False

    def allows(self, value: object) -> bool:
        if value is None:
            return self.nullable
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if self.kind is int and not isinstance(value, int):
            return False
        if isinstance(value, float) and not math.isfinite(value):
            return False
        return (value > self.low if self.above_low else value >= self.low) and value <= self.high


@dataclass(frozen=True)
class Text:
    """A string of low..high characters, matching `pattern` (from its start if `prefix`)."""

    low: int
    high: int
    pattern: str | None = None
    prefix: bool = False
    nullable: bool = False

    def allows(self, value: object) -> bool:
        if value is None:
            return self.nullable
        if not isinstance(value, str) or not self.low <= len(value) <= self.high:
            return False
        if self.pattern is None:
            return True
        match = re.match if self.prefix else re.fullmatch
        return match(self.pattern, value) is not None


@dataclass(frozen=True)
class Names:
    """A JSON array of at most `most` strings of low..high characters."""

    most: int
    low: int
    high: int

    def allows(self, value: object) -> bool:
        return (isinstance(value, list) and len(value) <= self.most
                and all(isinstance(name, str) and self.low <= len(name) <= self.high
                        for name in value))


@dataclass(frozen=True)
class OneOf:
    """Exactly one of `values`, of its own JSON type (`true` is not 1)."""

    values: tuple[object, ...]

    def allows(self, value: object) -> bool:
        return any(type(value) is type(known) and value == known for known in self.values)


@dataclass(frozen=True)
class Obj:
    """A JSON object with these fields (name -> (spec, required)), and no others."""

    fields: dict[str, tuple[Spec, bool]]


Leaf = Num | Text | Names | OneOf
Spec = Leaf | Obj

SEQS = 10_000_000
LATENCY = Num(float, 0, 86_400_000, nullable=True)
RATE = Num(float, 0, 1e12, nullable=True)
WORKER_ID = Text(1, 200, r"[A-Za-z0-9._:@-]+")
HEARTBEAT = Obj({
    "schema_version": (OneOf((1,)), False),
    "worker_id": (WORKER_ID, True),
    "region": (Text(1, 64), True),
    "endpoint": (Text(1, 500, r"https?://", prefix=True), True),
    "models": (Names(4096, 1, 256), True),
    "lora_adapters": (Names(4096, 1, 256), False),
    "state": (OneOf(("starting", "ready", "draining", "degraded")), True),
    "capacity": (Obj({"max_num_seqs": (Num(int, 1, SEQS), True),
                      "kv_blocks_total": (Num(int, 0, 1e9, nullable=True), False),
                      "block_size_tokens": (Num(int, 1, 2**20, nullable=True), False)}), True),
    "load": (Obj({"running": (Num(int, 0, SEQS), True), "waiting": (Num(int, 0, SEQS), True),
                  "kv_cache_usage": (Num(float, 0, 1, nullable=True), True)}), True),
    "performance": (Obj({name: (spec, False) for name, spec in (
        ("ttft_ms", LATENCY), ("itl_ms", LATENCY), ("e2e_ms", LATENCY),
        ("prefill_tokens_per_s", RATE), ("decode_tokens_per_s", RATE))}), False),
    "engine": (Obj({"kind": (OneOf(("vllm", "sim", "openai")), False),
                    "version": (Text(0, 256, nullable=True), False),
                    "kv_usage_metric": (Text(0, 256, nullable=True), False),
                    "metric_names": (Names(4096, 0, 256), False)}), False),
    "seq": (Num(int, 0, 2**63 - 1), True),
    "sent_at_s": (Num(float, 0, 1e11), True),
    "ttl_s": (Num(float, 0, 3600, above_low=True), True),
    "key_id": (Text(1, 64, r"[A-Za-z0-9._-]+", nullable=True), False),
    "signature": (Text(1, 128, r"[0-9a-f]+", nullable=True), False),
})
RECORD_ITEMS: tuple[tuple[str, Leaf], ...] = (
    ("version", OneOf((1,))), ("worker_id", WORKER_ID), ("seq", Num(int, 0, 2**63 - 1)),
    ("sent_at_s", Num(float, 0, 1e11)), ("static_digest", Num(int, 0, 2**32 - 1)),
    ("running", Num(int, 0, SEQS)), ("waiting", Num(int, 0, SEQS)),
    ("kv_cache_usage", Num(float, 0, 1, nullable=True)), ("ttft_ms", LATENCY),
    ("itl_ms", LATENCY), ("e2e_ms", LATENCY), ("prefill_tokens_per_s", RATE),
    ("decode_tokens_per_s", RATE))
SIGNED_ITEMS = (*RECORD_ITEMS, ("key_id", Text(1, 64, r"[A-Za-z0-9._-]+")),
                ("signature", Text(1, 128, r"[0-9a-f]+")))
MAX_HEARTBEAT_BYTES = 1 << 20
MAX_RECORD_BYTES = 1024


def first_error(value: object, spec: Spec, path: str) -> str | None:
    """The reason the schema must give for `value` at `path` (its first error, in field
    order, unknown fields after the known), or None when it takes it."""
    if not isinstance(spec, Obj):
        return None if spec.allows(value) else f"invalid:{path}"
    if not isinstance(value, dict):
        return f"invalid:{path or 'heartbeat'}"
    for name, (field, required) in spec.fields.items():
        where = f"{path}.{name}" if path else name
        if name not in value:
            if required:
                return f"invalid:{where}"
            continue
        error = first_error(value[name], field, where)
        if error is not None:
            return error
    return "unknown_field" if set(value) - set(spec.fields) else None


def unreadable(payload: bytes, limit_bytes: int) -> str | None:
    """Why the schema must refuse these bytes before looking at any field, or None. JSON
    as JSON parsers read it: NaN and infinities are numbers; of a key given twice, the
    last counts."""
    if len(payload) > limit_bytes:
        return "oversize"
    try:
        pydantic_core.from_json(payload)
    except ValueError:
        return "malformed_json"
    return None


def heartbeat_reason(payload: bytes) -> str | None:
    """Why the spec refuses a heartbeat's bytes, or None."""
    return (unreadable(payload, MAX_HEARTBEAT_BYTES)
            or first_error(pydantic_core.from_json(payload), HEARTBEAT, ""))


def record_reason(payload: bytes) -> str | None:
    """The same for a load record (an array; one ending in a string is signed)."""
    reason = unreadable(payload, MAX_RECORD_BYTES)
    if reason is not None:
        return reason
    items = pydantic_core.from_json(payload)
    spec = SIGNED_ITEMS if payload.endswith(b'"]') else RECORD_ITEMS
    if not isinstance(items, list) or len(items) > len(spec):
        return "invalid:load_record"
    for index, (name, item) in enumerate(spec):
        if index >= len(items) or not item.allows(items[index]):
            return f"invalid:load_record.{name}"
    return None


# --- documents and what is done to them --------------------------------------------------
# A JSON object as written: its (key, value) pairs in order, a value raw JSON bytes or an
# object; so that a field can be written twice, or as no serializer would.
Doc = list[tuple[str, "bytes | Doc"]]
SEPARATORS = ((b",", b":"), (b", ", b": "), (b",\n  ", b" : "))


def as_doc(value: dict[str, Any]) -> Doc:
    return [(key, as_doc(item) if isinstance(item, dict) else json.dumps(item).encode())
            for key, item in value.items()]


def render(doc: Doc, separators: tuple[bytes, bytes] = SEPARATORS[0]) -> bytes:
    comma, colon = separators
    return b"{" + comma.join(
        json.dumps(key).encode() + colon
        + (render(value, separators) if isinstance(value, list) else value)
        for key, value in doc) + b"}"


def edit(doc: Doc, path: str, change: Callable[[Doc, str], Doc]) -> Doc:
    """`doc` with `change(object, name)` applied to the object holding `path`'s last
    name (the objects on the way are copied, never changed)."""
    head, _, rest = path.partition(".")
    if not rest:
        return change(doc, head)
    return [(key, edit(value, rest, change) if key == head and isinstance(value, list)
             else value) for key, value in doc]


def replaced(doc: Doc, path: str, raw: bytes) -> Doc:
    return edit(doc, path, lambda obj, name: [(k, raw if k == name else v) for k, v in obj])


def without(doc: Doc, path: str) -> Doc:
    return edit(doc, path, lambda obj, name: [(k, v) for k, v in obj if k != name])


def with_pair(doc: Doc, path: str, raw: bytes, *, first: bool) -> Doc:
    """`doc` with one more pair named `path`'s last name, before or after the others."""
    return edit(doc, path, lambda obj, name: [(name, raw), *obj] if first
                else [*obj, (name, raw)])


def leaves(spec: Obj, prefix: str = "") -> Iterator[tuple[str, Spec]]:
    for name, (field, _) in spec.fields.items():
        yield prefix + name, field
        if isinstance(field, Obj):
            yield from leaves(field, f"{prefix}{name}.")


PATHS = dict(leaves(HEARTBEAT))
OBJECTS = ["", *(path for path, spec in PATHS.items() if isinstance(spec, Obj))]


def base_heartbeat(worker_id: str = "fz-0", region: str = "us-east",
                   endpoint: str = "http://127.0.0.1:9") -> Heartbeat:
    """What an agent of a busy vLLM reports: every field there, as a mutation's start."""
    return Heartbeat(
        worker_id=worker_id, region=region, endpoint=endpoint, models=("m",),
        lora_adapters=("m-lora",), state=LifecycleState.READY,
        capacity=Capacity(max_num_seqs=8, kv_blocks_total=4096, block_size_tokens=16),
        load=Load(running=3, waiting=1, kv_cache_usage=0.5),
        performance=Performance(ttft_ms=120.0, itl_ms=20.0, e2e_ms=900.0,
                                prefill_tokens_per_s=5000.0, decode_tokens_per_s=250.0),
        engine=EngineInfo(version="0.32.0", kv_usage_metric="vllm:kv_cache_usage_perc",
                          metric_names=("vllm:num_requests_running",)),
        seq=7, sent_at_s=1_764_500_000.25, ttl_s=30.0)


# --- hostile values ----------------------------------------------------------------------

ODD = [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e999", b"true", b"false", b"null",
       b'"1"', b'"NaN"', b"[]", b"{}", b"[1]", b'{"a":1}', b"-0.0", b"0", b"-1", b"0.5",
       b"5e-324", b"1e308", b"-1e308", b"1e2", b"1.0", str(2**63).encode(),
       str(2**64).encode(), b"1" + b"0" * 30, b'"\\ud800"', b'"\\u00e9"']
NUMBERS = st.one_of(
    st.sampled_from(ODD),
    st.integers(-2**70, 2**70).map(lambda n: str(n).encode()),
    st.floats(allow_nan=False, allow_infinity=False).map(lambda f: repr(f).encode()))
TEXTS = st.one_of(
    st.text(max_size=40).map(lambda t: json.dumps(t).encode()),
    st.text(max_size=20).map(lambda t: json.dumps(t, ensure_ascii=False).encode()),
    st.sampled_from([json.dumps("x" * 257).encode(), json.dumps("\u00e9" * 65).encode(),
                     b'"a b"', b'"a\\n"', b'"http://ok"', b'"w-1"', b'""']))
NAME_LISTS = st.one_of(
    st.lists(st.text(max_size=12), max_size=5).map(lambda v: json.dumps(v).encode()),
    st.sampled_from([json.dumps(["m"] * 4097).encode(), json.dumps(["x" * 257]).encode(),
                     b'"m"', b"[1]", b'["m",null]']))


def edges(spec: Num) -> list[bytes]:
    """The numbers at and just past a spec's limits."""
    if spec.kind is int:
        return [str(int(n)).encode() for n in (spec.low, spec.high, spec.low - 1, spec.high + 1)]
    return [repr(n).encode() for n in (spec.low, spec.high, math.nextafter(spec.high, math.inf),
                                       math.nextafter(spec.low, -math.inf))]


def hostile_value(spec: Spec) -> st.SearchStrategy[bytes]:
    """Raw JSON aimed at a field of `spec`: what it takes just so, and what it must not."""
    if isinstance(spec, Num):
        return st.one_of(NUMBERS, st.sampled_from(edges(spec)))
    if isinstance(spec, Text):
        return st.one_of(TEXTS, st.sampled_from(ODD))
    if isinstance(spec, Names):
        return st.one_of(NAME_LISTS, st.sampled_from(ODD))
    if isinstance(spec, OneOf):
        known = [json.dumps(value).encode() for value in spec.values]
        return st.one_of(st.sampled_from(known), TEXTS, st.sampled_from(ODD))
    return st.sampled_from(ODD)


def in_range(spec: Num) -> st.SearchStrategy[bytes]:
    """A number the spec takes, often at its limits (where arithmetic overflows)."""
    if spec.kind is int:
        values: st.SearchStrategy[Any] = st.integers(int(spec.low) + spec.above_low,
                                                     int(spec.high))
    else:
        values = st.floats(spec.low, spec.high, exclude_min=spec.above_low)
    limits = [spec.kind(limit) for limit in ((spec.high,) if spec.above_low
                                             else (spec.low, spec.high))]
    return st.one_of(values, st.sampled_from(limits)).map(lambda n: json.dumps(n).encode())


# --- hostile heartbeats ------------------------------------------------------------------
# Each strategy takes the valid document to start from and returns (kind, payload).
Mutation = Callable[[Doc], st.SearchStrategy[tuple[str, bytes]]]


@st.composite
def one_field(draw: st.DrawFn, doc: Doc) -> tuple[str, bytes]:
    path = draw(st.sampled_from(sorted(PATHS)))
    spec = PATHS[path]
    return type(spec).__name__.lower(), render(replaced(doc, path, draw(hostile_value(spec))),
                                               draw(st.sampled_from(SEPARATORS)))


@st.composite
def structure(draw: st.DrawFn, doc: Doc) -> tuple[str, bytes]:
    kind = draw(st.sampled_from(["missing", "unknown_field", "duplicate"]))
    if kind == "missing":
        return kind, render(without(doc, draw(st.sampled_from(sorted(PATHS)))))
    if kind == "unknown_field":
        where = draw(st.sampled_from(OBJECTS))
        spec = PATHS[where] if where else HEARTBEAT
        assert isinstance(spec, Obj)
        name = draw(st.text(min_size=1, max_size=12).filter(
            lambda n: n not in spec.fields and "." not in n))
        path = f"{where}.{name}" if where else name
        return kind, render(with_pair(doc, path, draw(NUMBERS), first=draw(st.booleans())))
    path = draw(st.sampled_from(sorted(PATHS)))
    return kind, render(with_pair(doc, path, draw(hostile_value(PATHS[path])),
                                  first=draw(st.booleans())))


@st.composite
def broken(draw: st.DrawFn, doc: Doc) -> tuple[str, bytes]:
    valid = render(doc)
    kind = draw(st.sampled_from(["truncated", "invalid_utf8", "oversize", "not_an_object",
                                 "garbage"]))
    if kind == "truncated":
        return kind, valid[:draw(st.integers(0, len(valid) - 1))]
    if kind == "invalid_utf8":
        return kind, render(replaced(doc, "region", b'"\xff\xfe"'))
    if kind == "oversize":  # valid JSON, padded past the limit
        return kind, valid[:-1] + b" " * MAX_HEARTBEAT_BYTES + b"}"
    if kind == "not_an_object":
        return kind, draw(st.sampled_from(ODD))
    return kind, draw(st.binary(max_size=60))


@st.composite
def extreme(draw: st.DrawFn, doc: Doc) -> tuple[str, bytes]:
    """Valid, with every number anywhere in its range: what the router's arithmetic must
    survive."""
    for path, spec in PATHS.items():
        if isinstance(spec, Num):
            doc = replaced(doc, path, draw(in_range(spec)))
    return "extreme", render(doc)


def hostile_heartbeats(doc: Doc) -> st.SearchStrategy[tuple[str, bytes]]:
    return st.one_of(one_field(doc), structure(doc), broken(doc), extreme(doc))


# --- hostile load records ----------------------------------------------------------------


def record_array(items: list[bytes], separator: bytes = b",") -> bytes:
    return b"[" + separator.join(items) + b"]"


@st.composite
def hostile_records(draw: st.DrawFn, items: list[bytes]) -> tuple[str, bytes]:
    kind = draw(st.sampled_from(["item", "item", "signed", "length", "broken", "extreme"]))
    signed = [*items, b'"k1"', b'"' + b"ab" * 32 + b'"']
    if kind == "item":
        index = draw(st.integers(0, len(items) - 1))
        changed = list(items)
        changed[index] = draw(hostile_value(RECORD_ITEMS[index][1]))
        return kind, record_array(changed, draw(st.sampled_from([b",", b", "])))
    if kind == "signed":
        index = draw(st.integers(len(items), len(signed) - 1))
        signed[index] = draw(hostile_value(SIGNED_ITEMS[index][1]))
        return kind, record_array(signed)
    if kind == "length":
        return kind, record_array(draw(st.sampled_from([signed, items]))[
            :draw(st.integers(0, len(signed) + 2))] + draw(st.lists(NUMBERS, max_size=3)))
    if kind == "broken":
        valid = record_array(items)
        return kind, draw(st.one_of(
            st.integers(0, len(valid) - 1).map(lambda cut: valid[:cut]),
            st.just(valid[:-1] + b" " * MAX_RECORD_BYTES + b"]"),
            st.sampled_from(ODD), st.binary(max_size=40)))
    changed = list(items)
    for index, (_, spec) in enumerate(RECORD_ITEMS):
        if isinstance(spec, Num):
            changed[index] = draw(in_range(spec))
    return kind, record_array(changed)


# --- what is done with what is taken -----------------------------------------------------

PLAIN = RouteRequest(model="m", origin_region="us-east", prompt_tokens=100)
REQUESTS = (
    PLAIN, PLAIN._replace(prompt_tokens=0), PLAIN._replace(prompt_tokens=10**6),
    PLAIN._replace(origin_region=None), PLAIN._replace(session_id="s-1"),
    PLAIN._replace(traffic_class="batch", ttft_budget_ms=500.0),
    PLAIN._replace(allowed_regions=frozenset({"eu-west"})),
    PLAIN._replace(avoid_regions=frozenset({"us-east"})))
# A small pool (every candidate scored) and one large enough to be ranked by region.
POOLS = ([view("good-1"), view("good-2", "eu-west")],
         [view(f"good-{i}", ("us-east", "eu-west")[i % 2]) for i in range(48)])
TERMS = ("queue_ms_per_request", "kv_pressure_ms", "prefill_ms_per_token", "utilisation",
         "first_step_ms", "engine_ms")


def route_over(taken: list[WorkerView]) -> int:
    """Route every kind of request over the taken views mixed with good ones: each
    decision has a finite predicted TTFT, or there is no route. The decisions made."""
    for taken_view in taken:
        for name in TERMS:
            assert math.isfinite(getattr(taken_view, name)), (name, taken_view)
    decisions = 0
    for pool in POOLS:
        snapshot = Snapshot.build([*pool, *taken], built_at_s=100.0, redis_connected=True,
                                  last_redis_ok_at_s=100.0)
        policy = make_policy()
        for request in REQUESTS:
            try:
                decision = policy.pick(snapshot, request)
            except NoRoute:
                continue
            assert math.isfinite(decision.predicted_ttft_ms), (request, decision)
            decisions += 1
    return decisions


TALLY: Counter[str] = Counter()
T = TypeVar("T")
BATCH = 40
FUZZ = settings(max_examples=110, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
BASE_DOC = as_doc(json.loads(base_heartbeat().to_json()))
BASE_ITEMS = [json.dumps(item).encode()
              for item in json.loads(load_record(base_heartbeat(), digest=12345))]


def judged(parse: Callable[[bytes], T], payload: bytes, expected: str | None,
           what: str) -> T | None:
    """`parse(payload)` when the spec takes the payload (`expected` is None), else None
    after checking the refusal gives `expected` as its reason; counted in TALLY."""
    try:
        parsed = parse(payload)
    except Refused as exc:
        assert exc.reason == expected, (payload[:300], str(exc))
        assert exc.reason in REFUSAL_REASONS
        TALLY[f"{what} refused"] += 1
        return None
    assert expected is None, (payload[:300], parsed)
    TALLY[f"{what} taken"] += 1
    return parsed


@FUZZ
@given(batch=st.lists(hostile_heartbeats(BASE_DOC), min_size=BATCH, max_size=BATCH))
def test_hostile_heartbeats_are_refused_by_reason_or_routed_over(
        batch: list[tuple[str, bytes]]) -> None:
    taken: list[WorkerView] = []
    for index, (_, payload) in enumerate(batch):
        heartbeat = judged(parse_heartbeat, payload, heartbeat_reason(payload), "heartbeats")
        if heartbeat is not None:
            # One worker per input (a fuzzed id may repeat); the router's clock is at 100 s.
            unique = heartbeat.model_copy(update={"worker_id": f"{heartbeat.worker_id}~{index}"})
            taken.append(WorkerView(unique, received_at_s=100.0))
    TALLY["heartbeat decisions"] += route_over(taken)


@FUZZ
@given(batch=st.lists(hostile_records(BASE_ITEMS), min_size=BATCH, max_size=BATCH))
def test_hostile_load_records_are_refused_by_reason_or_routed_over(
        batch: list[tuple[str, bytes]]) -> None:
    base = WorkerView(base_heartbeat(), received_at_s=99.0)
    taken = [base.with_load(items, 100.0, 0) for _, payload in batch
             if (items := judged(record_items, payload, record_reason(payload), "records"))
             is not None]
    # The views are of one worker: route over each on its own beside the good ones.
    TALLY["record decisions"] += sum(route_over([one]) for one in taken[:8])


# --- defence in depth: views of heartbeats that skipped validation -----------------------


def unvalidated(worker_id: str, e2e_ms: float | None = None,
                prefill_tokens_per_s: float | None = None) -> WorkerView:
    """A view of a heartbeat whose figures never met the schema (`model_construct`), as
    the issue's `inf` reached the snapshot before the schema refused it."""
    performance = Performance.model_construct(e2e_ms=e2e_ms,
                                              prefill_tokens_per_s=prefill_tokens_per_s)
    heartbeat = view(worker_id).heartbeat.model_copy(update={"performance": performance})
    return WorkerView(heartbeat, received_at_s=100.0)


def test_two_workers_reporting_infinity_leave_the_model_routable() -> None:
    odd = [unvalidated("inf-1", e2e_ms=math.inf), unvalidated("inf-2", e2e_ms=math.inf),
           unvalidated("nan-1", e2e_ms=math.nan, prefill_tokens_per_s=math.nan),
           unvalidated("tiny-1", prefill_tokens_per_s=5e-324)]
    snapshot = Snapshot.build(odd[:2], built_at_s=100.0, redis_connected=True,
                              last_redis_ok_at_s=100.0)
    # The issue: 0.0 * inf is NaN in every score, and the pick raised IndexError.
    decision = make_policy().pick(snapshot, PLAIN._replace(prompt_tokens=0))
    assert decision.worker.worker_id in ("inf-1", "inf-2")
    assert math.isfinite(decision.predicted_ttft_ms)
    for one in odd:
        assert all(math.isfinite(getattr(one, name)) for name in TERMS), one
    assert route_over(odd) > 0


# --- the agent's side: odd engine metrics ------------------------------------------------

CAPTURE = (Path(__file__).resolve().parents[1] / "fixtures" / "vllm-0.32-cpu-metrics.txt"
           ).read_text()
SAMPLE_LINE = re.compile(r"^(vllm:[^\s{]+(?:\{[^}]*\})?) (\S+)$", re.MULTILINE)
ODD_SAMPLES = ("NaN", "+Inf", "-Inf", "1e308", "-1e308", "1.7976931348623157e+308", "-5",
               "0.5", "1e-300", "123456789012")
IDENTITY = WorkerIdentity("us-east-1", "us-east", "http://127.0.0.1:8000", 256)
RUNNING = "vllm:num_requests_running"


def agent_heartbeat(*texts: str) -> Heartbeat | None:
    """The heartbeat an agent builds after scraping these /metrics texts in turn (None if
    the last is refused as unusable: the agent then reports the probe's failure)."""
    tracker = PerformanceTracker()
    sample = None
    performance = Performance()
    for text in texts:
        try:
            sample = parse_metrics(text)
        except MetricsFormatError:
            return None
        performance = tracker.update(sample)
    view_ = EngineView(metrics=sample, models=ServedModels(("m",), ()),
                       version=EngineVersion("0.32.0"))
    return build_heartbeat(IDENTITY, view_, state=LifecycleState.READY,
                           performance=performance, seq=1, sent_at_s=1_764_500_000.0,
                           ttl_s=2.0)


def publishable(heartbeat: Heartbeat) -> None:
    """What the agent publishes from it can be written (JSON without NaN) and is taken."""
    signed = HeartbeatSigner("k1", b"a-test-secret-of-at-least-32-bytes!!")
    assert parse_heartbeat(canonical_bytes(heartbeat)) == heartbeat
    assert record_items(signed.signed_record(load_record(heartbeat)))
    assert parse_heartbeat(heartbeat.to_json()) == heartbeat


def set_samples(text: str, name: str, value: str) -> str:
    """The capture with every sample whose name matches `name` (a regex) set to `value`."""
    return re.sub(rf"^({name}(?:\{{[^}}]*\}})?) \S+$", rf"\1 {value}", text, flags=re.MULTILINE)


def test_nan_and_infinite_engine_metrics_are_dropped_not_published() -> None:
    # Running or waiting that is no number: as if not exposed (the probe reports it).
    for value in ("NaN", "+Inf", "-Inf"):
        assert agent_heartbeat(CAPTURE, set_samples(CAPTURE, RUNNING, value)) is None
    assert agent_heartbeat(CAPTURE, set_samples(CAPTURE, r"vllm:[a-z_:]+", "NaN")) is None
    # Anything else that is no number is left out of the heartbeat, never sent.
    odd = set_samples(set_samples(CAPTURE, r"vllm:kv_cache_usage_perc", "+Inf"),
                      r"vllm:[a-z_:]+_sum", "+Inf").replace('num_gpu_blocks="512"',
                                                           'num_gpu_blocks="inf"')
    heartbeat = agent_heartbeat(CAPTURE, odd)
    assert heartbeat is not None
    publishable(heartbeat)
    assert heartbeat.load.kv_cache_usage is None and heartbeat.capacity.kv_blocks_total is None
    assert heartbeat.performance.ttft_ms is None and heartbeat.performance.e2e_ms is None
    # Finite but huge (sums that overflow to inf, counts past the limit): clamped or left
    # out, within the limits.
    huge = set_samples(set_samples(CAPTURE, r"vllm:[a-z_:]+_(sum|total)", "1e308"),
                       RUNNING, "1e300")
    heartbeat = agent_heartbeat(CAPTURE, huge, set_samples(huge, r"vllm:[a-z_:]+_sum", "-1e308"))
    assert heartbeat is not None and heartbeat.load.running == 10_000_000
    publishable(heartbeat)


@settings(max_examples=150, deadline=None)
@given(changes=st.lists(st.tuples(st.integers(0, 10_000), st.sampled_from(ODD_SAMPLES)),
                        max_size=12),
       later=st.lists(st.tuples(st.integers(0, 10_000), st.sampled_from(ODD_SAMPLES)),
                      max_size=12))
def test_odd_engine_metrics_never_make_an_unpublishable_heartbeat(
        changes: list[tuple[int, str]], later: list[tuple[int, str]]) -> None:
    def altered(edits: list[tuple[int, str]]) -> str:
        lines = CAPTURE.splitlines()
        samples = [i for i, line in enumerate(lines) if SAMPLE_LINE.match(line)]
        for which, value in edits:
            index = samples[which % len(samples)]
            lines[index] = f"{lines[index].rsplit(' ', 1)[0]} {value}"
        return "\n".join(lines) + "\n"

    heartbeat = agent_heartbeat(altered(changes), altered(later))
    TALLY["metrics texts"] += 2
    if heartbeat is not None:
        publishable(heartbeat)


@pytest.mark.parametrize(("parse", "answer", "why"), [
    (parse_models, {"data": [{"id": "m" * 257}]}, "257 characters"),
    (parse_models, {"data": [{"id": ""}]}, "0 characters"),
    (parse_models, {"data": [{"id": f"a{i}", "parent": "m"} for i in range(4097)]},
     "4097 adapters"),
    (parse_version, {"version": "0." * 200}, "1 to 256 characters"),
])
def test_engine_names_a_heartbeat_cannot_carry_are_a_probe_error(
        parse: Callable[[Any], object], answer: object, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse(answer)


def test_print_the_fuzzing_counts() -> None:
    """Runs after the tests above (file order): the figures for the README."""
    print("\nheartbeat fuzzing (unit):", ", ".join(f"{name} {count:,}"
                                                for name, count in sorted(TALLY.items())))
