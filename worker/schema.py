"""The versioned heartbeat: the one contract between worker agents and routers.

A worker agent publishes a `Heartbeat` to Redis every interval; routers read it. This is
the one module of `worker` that `router` imports. `HeartbeatKeys` is the one place that
knows the Redis key and channel names.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from enum import StrEnum
from typing import Annotated, Any, Literal, NamedTuple, NewType

from pydantic import BaseModel, ConfigDict, Field, GetPydanticSchema
from pydantic_core import ErrorDetails, SchemaValidator, ValidationError, core_schema

SCHEMA_VERSION: Literal[1] = 1

# --- bounds ------------------------------------------------------------------------------
# Every number a heartbeat or a load record carries has one set of limits, defined here
# once as pydantic-core schemas and used by both: the Heartbeat model's fields and the load
# record's tuple schema (`_RECORD`), each checked in pydantic-core's one pass over the JSON.
# Finite (JSON parsers accept `NaN`, `Infinity` and `1e999`; 0.0 * inf is NaN in the
# router's scores), of their JSON type (strict: no `true` for a count, no "1.5" for a
# figure), and in a range wide enough for any engine yet narrow enough that the router's
# arithmetic on them (router.registry.snapshot, router.policy) stays finite.
MAX_SEQS = 10_000_000  # running, waiting, max_num_seqs
MAX_KV_BLOCKS = 1_000_000_000
MAX_BLOCK_SIZE_TOKENS = 1 << 20
MAX_SEQ = 2**63 - 1  # a heartbeat's sequence number (an int64)
MAX_DIGEST = 2**32 - 1  # static_digest is a CRC-32
MAX_SENT_AT_S = 1e11  # Unix time (the year 5138)
MAX_TTL_S = 3600.0
MAX_LATENCY_MS = 86_400_000.0  # a day
MAX_TOKENS_PER_S = 1e12
# Sizes. The byte limits are checked before parsing (`parse_heartbeat`, `record_items`):
# what a router keeps per worker is bounded whatever a heartbeat lists. A heartbeat as
# agents write it is ~0.7 kB, a load record ~150 B (signed ~230 B).
MAX_HEARTBEAT_BYTES = 1 << 20
MAX_RECORD_BYTES = 1024
MAX_NAMES = 4096  # models, and LoRA adapters, one worker serves
MAX_NAME_CHARS = 256


def _count(high: int, low: int = 0) -> core_schema.IntSchema:
    return core_schema.int_schema(ge=low, le=high, strict=True)


def _number(high: float, low: float = 0.0, *, above_low: bool = False
            ) -> core_schema.FloatSchema:
    if above_low:
        return core_schema.float_schema(strict=True, allow_inf_nan=False, gt=low, le=high)
    return core_schema.float_schema(strict=True, allow_inf_nan=False, ge=low, le=high)


def _version(version: int) -> core_schema.ChainSchema:
    """Exactly `version`, an integer (a literal alone also takes `true` and `1.0`)."""
    return core_schema.chain_schema([core_schema.int_schema(strict=True),
                                     core_schema.literal_schema([version])])


_SEQS = _count(MAX_SEQS)
_SLOTS = _count(MAX_SEQS, low=1)
_KV_BLOCKS = _count(MAX_KV_BLOCKS)
_BLOCK_SIZE = _count(MAX_BLOCK_SIZE_TOKENS, low=1)
_ORDER = _count(MAX_SEQ)
_DIGEST = _count(MAX_DIGEST)
_SENT_AT = _number(MAX_SENT_AT_S)
_TTL = _number(MAX_TTL_S, above_low=True)
_KV_USAGE = _number(1.0)
_LATENCY = _number(MAX_LATENCY_MS)
_RATE = _number(MAX_TOKENS_PER_S)


def _checked_by(schema: core_schema.CoreSchema) -> GetPydanticSchema:
    """A field annotation that validates with `schema`, the same object the load record's
    schema uses: one definition of each number's limits."""
    return GetPydanticSchema(lambda _source, _handler: schema)


Seqs = Annotated[int, _checked_by(_SEQS)]
Slots = Annotated[int, _checked_by(_SLOTS)]
KvBlocks = Annotated[int, _checked_by(_KV_BLOCKS)]
BlockSizeTokens = Annotated[int, _checked_by(_BLOCK_SIZE)]
SeqNumber = Annotated[int, _checked_by(_ORDER)]
SentAtS = Annotated[float, _checked_by(_SENT_AT)]
TtlS = Annotated[float, _checked_by(_TTL)]
KvUsage = Annotated[float, _checked_by(_KV_USAGE)]
LatencyMs = Annotated[float, _checked_by(_LATENCY)]
TokensPerS = Annotated[float, _checked_by(_RATE)]
Names = Annotated[tuple[Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS)], ...],
                  Field(max_length=MAX_NAMES)]


class LifecycleState(StrEnum):
    """Where a worker is in its life. Only `ready` workers receive new requests."""

    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    DEGRADED = "degraded"


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Capacity(_Frozen):
    """What the engine can hold at once."""

    max_num_seqs: Slots = Field(description="sequences the engine runs concurrently")
    kv_blocks_total: KvBlocks | None = None
    block_size_tokens: BlockSizeTokens | None = None


class Load(_Frozen):
    """The engine's load when the heartbeat was taken."""

    running: Seqs = Field(description="sequences in the running batch")
    waiting: Seqs = Field(description="requests queued in the engine")
    kv_cache_usage: KvUsage | None = Field(
        description="fraction of KV blocks in use; None when the engine exposes no KV metric "
        "(never a silent 0: see EngineInfo.kv_usage_metric)",
    )


class Performance(_Frozen):
    """Recent performance, averaged over the last heartbeat interval(s); None if no traffic."""

    ttft_ms: LatencyMs | None = None
    itl_ms: LatencyMs | None = None
    e2e_ms: LatencyMs | None = None
    prefill_tokens_per_s: TokensPerS | None = None
    decode_tokens_per_s: TokensPerS | None = None


class EngineInfo(_Frozen):
    """Which engine a heartbeat describes, so a metric rename is visible, not silent."""

    kind: Literal["vllm", "sim", "openai"] = "vllm"
    version: str | None = Field(default=None, max_length=MAX_NAME_CHARS)
    kv_usage_metric: str | None = Field(
        default=None, max_length=MAX_NAME_CHARS,
        description="the metric KV usage was read from, e.g. vllm:kv_cache_usage_perc")
    metric_names: tuple[Annotated[str, Field(max_length=MAX_NAME_CHARS)], ...] = Field(
        default=(), max_length=MAX_NAMES)


class Heartbeat(_Frozen):
    """One report of a worker's identity, state, capacity and load.

    `sent_at_s` is Unix time in seconds at the sender; `ttl_s` is how long the report
    stays valid (the Redis key expires then); `seq` increases by one per heartbeat of
    one worker process so that receivers can drop replays and out-of-order reports.
    Every number is finite and within the limits above (MAX_*).
    """

    schema_version: Annotated[Literal[1], _checked_by(_version(SCHEMA_VERSION))] = SCHEMA_VERSION
    worker_id: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:@-]+$")
    region: str = Field(min_length=1, max_length=64)
    endpoint: str = Field(min_length=1, max_length=500, pattern=r"^https?://")
    models: Names
    lora_adapters: Names = ()
    state: LifecycleState
    capacity: Capacity
    load: Load
    performance: Performance = Performance()
    engine: EngineInfo = EngineInfo()
    seq: SeqNumber
    sent_at_s: SentAtS
    ttl_s: TtlS
    # HMAC-SHA256 (hex) over the heartbeat without this field, by the key `key_id`
    # (see worker.signing). Both None in unsigned heartbeats, which routers accept only
    # while they have no signing keys configured.
    key_id: str | None = Field(default=None, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    signature: str | None = Field(default=None, max_length=128, pattern=r"^[0-9a-f]+$")

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, payload: str | bytes) -> Heartbeat:
        """Parse and validate; raises pydantic.ValidationError on anything malformed (the
        router reads heartbeats with `parse_heartbeat`, which also says why)."""
        return cls.model_validate_json(payload)


# --- refusals ----------------------------------------------------------------------------
# Why the schema refuses a heartbeat or a load record, as a bounded set of names fit for a
# metric label (router.registry.collector counts refusals by them): the path of the field
# at fault among the schema's own field names, never text taken from the input.
#
# A key given twice is not refused. A load record is an array: it has no keys. Of a
# heartbeat's, everything in the router reads the last (pydantic-core, and the collector's
# own reads of the bytes, which it checks against the parsed heartbeat), and a signature
# covers the bytes as sent, so a duplicate cannot show two readers two heartbeats. Refusing
# them exactly takes a second pass over the JSON: 0.55x a parse's time more with jiter's
# catch_duplicate_keys (not a runtime dependency), 1.8x with json's object_pairs_hook or
# a regex counting keys (measured on a 0.7 kB heartbeat).
MALFORMED_JSON = "malformed_json"  # not JSON (or not UTF-8)
OVERSIZE = "oversize"  # over MAX_HEARTBEAT_BYTES or MAX_RECORD_BYTES, refused unread
UNKNOWN_FIELD = "unknown_field"  # a field the schema does not have


class Refused(ValueError):
    """A heartbeat or load record the schema refuses: `reason` is one of SCHEMA_REFUSALS,
    the message says what is wrong (for a log)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _field_paths(model: type[BaseModel], prefix: str = "") -> Iterator[str]:
    for name, field in model.model_fields.items():
        yield prefix + name
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from _field_paths(field.annotation, f"{prefix}{name}.")


HEARTBEAT_FIELDS = frozenset(_field_paths(Heartbeat))  # "performance.ttft_ms", ...


def parse_heartbeat(payload: str | bytes) -> Heartbeat:
    """A heartbeat as the router reads it from Redis: refused unread over
    MAX_HEARTBEAT_BYTES, else validated in one pass (`Heartbeat.from_json`). Raises
    Refused, saying why."""
    if len(payload) > MAX_HEARTBEAT_BYTES:
        raise Refused(OVERSIZE, f"heartbeat of {len(payload):,} bytes "
                                f"(at most {MAX_HEARTBEAT_BYTES:,})")
    try:
        return Heartbeat.model_validate_json(payload)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])[:80] or "heartbeat"
        raise Refused(_heartbeat_reason(error), f"{where}: {error['msg']}") from None


def _heartbeat_reason(error: ErrorDetails) -> str:
    kind = error["type"]
    if kind == "json_invalid":
        return MALFORMED_JSON
    if kind == "extra_forbidden":
        return UNKNOWN_FIELD
    names = [part for part in error["loc"] if isinstance(part, str)]  # not item indices
    while names and ".".join(names) not in HEARTBEAT_FIELDS:
        names.pop()
    return f"invalid:{'.'.join(names) or 'heartbeat'}"


class HeartbeatKeys:
    """Redis names for heartbeats under one namespace prefix.

    - `worker(id)`: a string key holding the worker's latest heartbeat JSON, with a TTL of
      `ttl_s`, rewritten every heartbeat (what a full read of the fleet finds).
    - `loads(region)`: a hash of the region's workers' load records (`load_record`),
      field = worker id, rewritten every heartbeat: what routers read in one go.
    - `channel`: pub/sub channel that routers follow; a message is a heartbeat JSON when
      anything but the load changed (a new worker, its state, models, capacity...), or
      `gone:<worker_id>` when a worker removes itself (drain finished).
    - `tap`: pub/sub channel with every heartbeat JSON, for people and tools watching
      the fleet (`redis-cli subscribe <prefix>:heartbeats:all`); routers do not read it.
    """

    GONE_PREFIX = "gone:"

    def __init__(self, prefix: str = "globalpool") -> None:
        self.prefix = prefix
        self.channel = f"{prefix}:heartbeats"
        self.tap = f"{prefix}:heartbeats:all"
        self.pattern = f"{prefix}:hb:*"
        self.loads_pattern = f"{prefix}:loads:*"

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}:hb:{worker_id}"

    def loads(self, region: str) -> str:
        return f"{self.prefix}:loads:{region}"

    def gone_message(self, worker_id: str) -> str:
        return f"{self.GONE_PREFIX}{worker_id}"


# --- load records ------------------------------------------------------------------------
# Between two changes of anything else, what changes from one heartbeat to the next is its
# order (seq, send time) and the engine's load and recent performance. Agents write those
# as a load record, a JSON array routers read for a whole region at once (HeartbeatKeys.
# loads) and parse in about two microseconds, not one full heartbeat message per worker:
#   [1, worker_id, seq, sent_at_s, static_digest, running, waiting, kv_cache_usage,
#    ttft_ms, itl_ms, e2e_ms, prefill_tokens_per_s, decode_tokens_per_s]
# followed, when signed, by key_id and signature (worker.signing.HeartbeatSigner.
# signed_record). `static_digest` names the rest of the heartbeat (`static_digest`): a
# router applies a record only onto the full heartbeat it was taken with.
LOAD_RECORD_VERSION = 1
LOAD_RECORD_FIELDS = 13


class LoadRecord(NamedTuple):
    """A load record as read (`LoadRecord.from_json`); the items of the JSON array after
    its version."""

    worker_id: str
    seq: int
    sent_at_s: float
    static_digest: int
    running: int
    waiting: int
    kv_cache_usage: float | None
    ttft_ms: float | None
    itl_ms: float | None
    e2e_ms: float | None
    prefill_tokens_per_s: float | None
    decode_tokens_per_s: float | None
    key_id: str | None = None
    signature: str | None = None

    @classmethod
    def from_json(cls, payload: bytes) -> LoadRecord:
        """Parse and validate a load record; raises ValueError naming what is wrong, with
        the same limits as the Heartbeat model's fields."""
        return cls.of(record_items(payload))

    @classmethod
    def of(cls, items: RecordItems) -> LoadRecord:
        """The record whose items `record_items` returned."""
        return cls._make(items[1:] if len(items) > LOAD_RECORD_FIELDS
                         else (*items[1:], None, None))


# A load record's items as `record_items` returns them: the JSON array's, in its order,
# version first (then LoadRecord's fields; key_id and signature only when signed). A type
# of its own so that a LoadRecord (a tuple too, without the version) cannot be passed
# where these are expected.
RecordItems = NewType("RecordItems", tuple[Any, ...])


def record_items(payload: bytes) -> RecordItems:
    """Parse and validate a load record in one pass of pydantic-core, as routers do for
    thousands a second: its items as a plain tuple (no object per record beyond it, half
    the cost of `LoadRecord.from_json`). Raises Refused (a ValueError) naming what is
    wrong, with the same limits as the Heartbeat model's fields."""
    if len(payload) > MAX_RECORD_BYTES:
        raise Refused(OVERSIZE, f"load record of {len(payload):,} bytes "
                                f"(at most {MAX_RECORD_BYTES:,})")
    signed = payload.endswith(b'"]')
    try:
        items: RecordItems = (_SIGNED_RECORD if signed else _RECORD).validate_json(payload)
    except ValidationError as exc:
        raise _record_refusal(exc.errors()[0]) from None
    return items


def _record_refusal(error: ErrorDetails) -> Refused:
    where = error["loc"]
    if where and isinstance(where[0], int) and where[0] < len(_RECORD_ITEM_NAMES):
        name = _RECORD_ITEM_NAMES[where[0]]
        return Refused(f"invalid:load_record.{name}", f"{name}: {error['msg']}")
    reason = MALFORMED_JSON if error["type"] == "json_invalid" else "invalid:load_record"
    return Refused(reason, f"load record: {error['msg']}")


_RECORD_ITEMS: list[core_schema.CoreSchema] = [
    _version(LOAD_RECORD_VERSION),
    core_schema.str_schema(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:@-]+$",
                           strict=True),  # worker id, as in Heartbeat
    _ORDER, _SENT_AT, _DIGEST, _SEQS, _SEQS,  # seq, sent_at_s, digest, running, waiting
    core_schema.nullable_schema(_KV_USAGE),
    *(core_schema.nullable_schema(_LATENCY) for _ in range(3)),  # ttft, itl, e2e (ms)
    *(core_schema.nullable_schema(_RATE) for _ in range(2)),  # prefill, decode tokens/s
]
_RECORD = SchemaValidator(core_schema.tuple_schema(_RECORD_ITEMS))
_SIGNED_RECORD = SchemaValidator(core_schema.tuple_schema([
    *_RECORD_ITEMS,
    core_schema.str_schema(max_length=64, pattern=r"^[A-Za-z0-9._-]+$", strict=True),  # key id
    core_schema.str_schema(max_length=128, pattern=r"^[0-9a-f]+$", strict=True)]))  # HMAC
_RECORD_ITEM_NAMES = ("version", *LoadRecord._fields)
# Every reason a Refused from this module can carry.
SCHEMA_REFUSALS = frozenset({
    MALFORMED_JSON, OVERSIZE, UNKNOWN_FIELD, "invalid:heartbeat", "invalid:load_record",
    *(f"invalid:{path}" for path in HEARTBEAT_FIELDS),
    *(f"invalid:load_record.{name}" for name in _RECORD_ITEM_NAMES)})


def static_digest(heartbeat: Heartbeat) -> int:
    """A CRC-32 of everything in `heartbeat` a load record does not carry (identity,
    state, models, capacity, engine, TTL, signing key): equal digests, same worker."""
    capacity, engine = heartbeat.capacity, heartbeat.engine
    text = "\x1f".join((
        heartbeat.worker_id, heartbeat.region, heartbeat.endpoint,
        "\x1e".join(heartbeat.models), "\x1e".join(heartbeat.lora_adapters),
        heartbeat.state.value, str(capacity.max_num_seqs), str(capacity.kv_blocks_total),
        str(capacity.block_size_tokens), engine.kind, str(engine.version),
        str(engine.kv_usage_metric), "\x1e".join(engine.metric_names),
        repr(heartbeat.ttl_s), str(heartbeat.key_id)))
    return zlib.crc32(text.encode("utf-8", "surrogatepass"))


def load_record(heartbeat: Heartbeat, digest: int | None = None) -> bytes:
    """The load record of `heartbeat` (unsigned), as JSON bytes."""
    load, performance = heartbeat.load, heartbeat.performance
    return json.dumps(
        [LOAD_RECORD_VERSION, heartbeat.worker_id, heartbeat.seq, heartbeat.sent_at_s,
         static_digest(heartbeat) if digest is None else digest, load.running,
         load.waiting, load.kv_cache_usage, performance.ttft_ms, performance.itl_ms,
         performance.e2e_ms, performance.prefill_tokens_per_s,
         performance.decode_tokens_per_s],
        separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()
