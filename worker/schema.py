"""The versioned heartbeat: the one contract between worker agents and routers.

A worker agent publishes a `Heartbeat` to Redis every interval; routers read it. Here: the
limits of every number it carries, the model, and why one is refused. Its Redis key and
channel names are in worker.heartbeat_keys, the load record (what changes between two
heartbeats) in worker.load_records.
"""

from __future__ import annotations

from collections.abc import Iterator
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetPydanticSchema,
    SerializerFunctionWrapHandler,
    model_serializer,
)
from pydantic_core import ErrorDetails, ValidationError, core_schema

SCHEMA_VERSION: Literal[1] = 1

# --- bounds ------------------------------------------------------------------------------
# Every number a heartbeat or a load record carries has one set of limits, defined here
# once as pydantic-core schemas and used by both: the Heartbeat model's fields and the load
# record's tuple schema (worker.load_records), each checked in pydantic-core's one pass over
# the JSON.
# Finite (JSON parsers accept `NaN`, `Infinity` and `1e999`; 0.0 * inf is NaN in the
# router's scores), of their JSON type (strict: no `true` for a count, no "1.5" for a
# figure), and in a range wide enough for any engine yet narrow enough that the router's
# arithmetic on them (router.registry.worker_view, router.policy) stays finite.
MAX_SEQS = 10_000_000  # running, waiting, max_num_seqs
MAX_KV_BLOCKS = 1_000_000_000
MAX_BLOCK_SIZE_TOKENS = 1 << 20
MAX_CONTEXT_TOKENS = 1 << 30  # max_model_len (the largest models serve ~10M)
MAX_SEQ = 2**63 - 1  # a heartbeat's sequence number (an int64)
MAX_DIGEST = 2**32 - 1  # static_digest is a CRC-32
MAX_SENT_AT_S = 1e11  # Unix time (the year 5138)
MAX_TTL_S = 3600.0
MAX_LATENCY_MS = 86_400_000.0  # a day
MAX_STUCK_S = 86_400.0  # a day (an agent reports longer as this)
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


def exact_version(version: int) -> core_schema.ChainSchema:
    """Exactly `version`, an integer (a literal alone also takes `true` and `1.0`)."""
    return core_schema.chain_schema([core_schema.int_schema(strict=True),
                                     core_schema.literal_schema([version])])


SEQS_SCHEMA = _count(MAX_SEQS)
SLOTS_SCHEMA = _count(MAX_SEQS, low=1)
KV_BLOCKS_SCHEMA = _count(MAX_KV_BLOCKS)
BLOCK_SIZE_SCHEMA = _count(MAX_BLOCK_SIZE_TOKENS, low=1)
CONTEXT_SCHEMA = _count(MAX_CONTEXT_TOKENS, low=1)
ORDER_SCHEMA = _count(MAX_SEQ)
DIGEST_SCHEMA = _count(MAX_DIGEST)
SENT_AT_SCHEMA = _number(MAX_SENT_AT_S)
TTL_SCHEMA = _number(MAX_TTL_S, above_low=True)
KV_USAGE_SCHEMA = _number(1.0)
LATENCY_SCHEMA = _number(MAX_LATENCY_MS)
RATE_SCHEMA = _number(MAX_TOKENS_PER_S)
STUCK_SCHEMA = _number(MAX_STUCK_S)


def _checked_by(schema: core_schema.CoreSchema) -> GetPydanticSchema:
    """A field annotation that validates with `schema`, the same object the load record's
    schema uses: one definition of each number's limits."""
    return GetPydanticSchema(lambda _source, _handler: schema)


Seqs = Annotated[int, _checked_by(SEQS_SCHEMA)]
Slots = Annotated[int, _checked_by(SLOTS_SCHEMA)]
KvBlocks = Annotated[int, _checked_by(KV_BLOCKS_SCHEMA)]
BlockSizeTokens = Annotated[int, _checked_by(BLOCK_SIZE_SCHEMA)]
ContextTokens = Annotated[int, _checked_by(CONTEXT_SCHEMA)]
SeqNumber = Annotated[int, _checked_by(ORDER_SCHEMA)]
SentAtS = Annotated[float, _checked_by(SENT_AT_SCHEMA)]
TtlS = Annotated[float, _checked_by(TTL_SCHEMA)]
KvUsage = Annotated[float, _checked_by(KV_USAGE_SCHEMA)]
LatencyMs = Annotated[float, _checked_by(LATENCY_SCHEMA)]
TokensPerS = Annotated[float, _checked_by(RATE_SCHEMA)]
StuckS = Annotated[float, _checked_by(STUCK_SCHEMA)]
Names = Annotated[tuple[Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS)], ...],
                  Field(max_length=MAX_NAMES)]


class LifecycleState(StrEnum):
    """Where a worker is in its life. Only `ready` workers receive new requests."""

    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    DEGRADED = "degraded"


def _without_if_none(data: object, name: str, value: object) -> object:
    """`data` (a model's fields as serialized) without the field `name` when its `value`
    is None: an optional field added to the schema stays out of the JSON until it has a
    value, so that routers older than it (which refuse unknown fields) still read it."""
    if value is None and isinstance(data, dict):
        del data[name]
    return data


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Capacity(_Frozen):
    """What the engine can hold at once."""

    max_num_seqs: Slots = Field(description="sequences the engine runs concurrently")
    kv_blocks_total: KvBlocks | None = None
    block_size_tokens: BlockSizeTokens | None = None
    max_model_len: ContextTokens | None = Field(
        default=None,
        description="the longest sequence (prompt and output tokens) the engine takes, from "
        "its /v1/models; None when it does not say, and then left out of the JSON, so that "
        "routers older than the field still read the heartbeat")

    @model_serializer(mode="wrap")
    def _context_only_when_known(self, handler: SerializerFunctionWrapHandler) -> object:
        return _without_if_none(handler(self), "max_model_len", self.max_model_len)


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
    stuck_for_s: StuckS | None = Field(
        default=None,
        description="how long the engine has held requests without running a step, once "
        "that is past the agent's --stuck-after-s (a wedged GPU: its /health and /metrics "
        "still answer); the worker is then `degraded`. None otherwise, and then left out "
        "of the JSON, so that routers older than the field still read the heartbeat")

    @model_serializer(mode="wrap")
    def _stuck_only_when_stuck(self, handler: SerializerFunctionWrapHandler) -> object:
        return _without_if_none(handler(self), "stuck_for_s", self.stuck_for_s)


class Heartbeat(_Frozen):
    """One report of a worker's identity, state, capacity and load.

    `sent_at_s` is Unix time in seconds at the sender; `ttl_s` is how long the report
    stays valid (the Redis key expires then); `seq` increases by one per heartbeat of
    one worker process so that receivers can drop replays and out-of-order reports.
    Every number is finite and within the limits above (MAX_*).
    """

    schema_version: Annotated[Literal[1], _checked_by(exact_version(SCHEMA_VERSION))] = (
        SCHEMA_VERSION)
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

    def condition(self) -> str:
        """Its state, and why when its agent says the engine is stuck (for events)."""
        stuck_for_s = self.engine.stuck_for_s
        if stuck_for_s is None:
            return self.state.value
        return (f"{self.state.value}: its engine has run no step for {stuck_for_s:.0f} s "
                "while holding requests")

    @classmethod
    def from_json(cls, payload: str | bytes) -> Heartbeat:
        """Parse and validate; raises pydantic.ValidationError on anything malformed (the
        router reads heartbeats with `parse_heartbeat`, which also says why)."""
        return cls.model_validate_json(payload)


# --- refusals ----------------------------------------------------------------------------
# Why the schema refuses a heartbeat or a load record, as a bounded set of names fit for a
# metric label (router.registry.refusals counts refusals by them): the path of the field
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
    """A heartbeat or load record the schema refuses: `reason` is one of HEARTBEAT_REFUSALS
    or worker.load_records.RECORD_REFUSALS, the message says what is wrong (for a log)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _field_paths(model: type[BaseModel], prefix: str = "") -> Iterator[str]:
    for name, field in model.model_fields.items():
        yield prefix + name
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from _field_paths(field.annotation, f"{prefix}{name}.")


HEARTBEAT_FIELDS = frozenset(_field_paths(Heartbeat))  # "performance.ttft_ms", ...
# Every reason a Refused from parse_heartbeat can carry.
HEARTBEAT_REFUSALS = frozenset({
    MALFORMED_JSON, OVERSIZE, UNKNOWN_FIELD, "invalid:heartbeat",
    *(f"invalid:{path}" for path in HEARTBEAT_FIELDS)})


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
