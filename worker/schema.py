"""The versioned heartbeat: the one contract between worker agents and routers.

A worker agent publishes a `Heartbeat` to Redis every interval; routers read it. This is
the one module of `worker` that `router` imports. `HeartbeatKeys` is the one place that
knows the Redis key and channel names.
"""

from __future__ import annotations

import json
import zlib
from enum import StrEnum
from typing import Any, Literal, NamedTuple, NewType

from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import SchemaValidator, ValidationError, core_schema

SCHEMA_VERSION: Literal[1] = 1


class LifecycleState(StrEnum):
    """Where a worker is in its life. Only `ready` workers receive new requests."""

    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    DEGRADED = "degraded"


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Capacity(_Frozen):
    """What the engine can hold at once."""

    max_num_seqs: int = Field(ge=1, description="sequences the engine runs concurrently")
    kv_blocks_total: int | None = Field(default=None, ge=0)
    block_size_tokens: int | None = Field(default=None, ge=1)


class Load(_Frozen):
    """The engine's load when the heartbeat was taken."""

    running: int = Field(ge=0, description="sequences in the running batch")
    waiting: int = Field(ge=0, description="requests queued in the engine")
    kv_cache_usage: float | None = Field(
        ge=0.0, le=1.0,
        description="fraction of KV blocks in use; None when the engine exposes no KV metric "
        "(never a silent 0: see EngineInfo.kv_usage_metric)",
    )


class Performance(_Frozen):
    """Recent performance, averaged over the last heartbeat interval(s); None if no traffic."""

    ttft_ms: float | None = Field(default=None, ge=0)
    itl_ms: float | None = Field(default=None, ge=0)
    e2e_ms: float | None = Field(default=None, ge=0)
    prefill_tokens_per_s: float | None = Field(default=None, ge=0)
    decode_tokens_per_s: float | None = Field(default=None, ge=0)


class EngineInfo(_Frozen):
    """Which engine a heartbeat describes, so a metric rename is visible, not silent."""

    kind: Literal["vllm", "sim", "openai"] = "vllm"
    version: str | None = None
    kv_usage_metric: str | None = Field(
        default=None, description="the metric KV usage was read from, e.g. vllm:kv_cache_usage_perc"
    )
    metric_names: tuple[str, ...] = ()


class Heartbeat(_Frozen):
    """One report of a worker's identity, state, capacity and load.

    `sent_at_s` is Unix time in seconds at the sender; `ttl_s` is how long the report
    stays valid (the Redis key expires then); `seq` increases by one per heartbeat of
    one worker process so that receivers can drop replays and out-of-order reports.
    """

    schema_version: Literal[1] = SCHEMA_VERSION
    worker_id: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:@-]+$")
    region: str = Field(min_length=1, max_length=64)
    endpoint: str = Field(min_length=1, max_length=500, pattern=r"^https?://")
    models: tuple[str, ...]
    lora_adapters: tuple[str, ...] = ()
    state: LifecycleState
    capacity: Capacity
    load: Load
    performance: Performance = Performance()
    engine: EngineInfo = EngineInfo()
    seq: int = Field(ge=0)
    sent_at_s: float
    ttl_s: float = Field(gt=0, le=3600)
    # HMAC-SHA256 (hex) over the heartbeat without this field, by the key `key_id`
    # (see worker.signing). Both None in unsigned heartbeats, which routers accept only
    # while they have no signing keys configured.
    key_id: str | None = Field(default=None, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    signature: str | None = Field(default=None, max_length=128, pattern=r"^[0-9a-f]+$")

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, payload: str | bytes) -> Heartbeat:
        """Parse and validate; raises pydantic.ValidationError on anything malformed."""
        return cls.model_validate_json(payload)


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
    the cost of `LoadRecord.from_json`). Raises ValueError naming what is wrong, with the
    same limits as the Heartbeat model's fields."""
    signed = payload.endswith(b'"]')
    try:
        items: RecordItems = (_SIGNED_RECORD if signed else _RECORD).validate_json(payload)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = error["loc"]
        name = (_RECORD_ITEM_NAMES[where[0]] if where and isinstance(where[0], int)
                and where[0] < len(_RECORD_ITEM_NAMES) else "load record")
        raise ValueError(f"{name}: {error['msg']}") from None
    return items


def _number(ge: float | None = None, le: float | None = None) -> core_schema.FloatSchema:
    return core_schema.float_schema(strict=True, allow_inf_nan=False, ge=ge, le=le)


_COUNT = core_schema.int_schema(ge=0, strict=True)
_FIGURE = core_schema.nullable_schema(_number(ge=0))
_RECORD_ITEMS: list[core_schema.CoreSchema] = [
    core_schema.literal_schema([LOAD_RECORD_VERSION]),
    core_schema.str_schema(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:@-]+$",
                           strict=True),  # worker id, as in Heartbeat
    _COUNT, _number(), _COUNT, _COUNT, _COUNT,  # seq, sent_at_s, digest, running, waiting
    core_schema.nullable_schema(_number(ge=0, le=1)),  # kv_cache_usage
    _FIGURE, _FIGURE, _FIGURE, _FIGURE, _FIGURE,
]
_RECORD = SchemaValidator(core_schema.tuple_schema(_RECORD_ITEMS))
_SIGNED_RECORD = SchemaValidator(core_schema.tuple_schema([
    *_RECORD_ITEMS,
    core_schema.str_schema(max_length=64, pattern=r"^[A-Za-z0-9._-]+$", strict=True),  # key id
    core_schema.str_schema(max_length=128, pattern=r"^[0-9a-f]+$", strict=True)]))  # HMAC
_RECORD_ITEM_NAMES = ("version", *LoadRecord._fields)


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
