"""Load records: a worker's heartbeat less what did not change, written and read in bulk.

Between two changes of anything else, what changes from one heartbeat to the next is its
order (seq, send time) and the engine's load and recent performance. Agents write those
as a load record, a JSON array routers read for a whole region at once (worker.
heartbeat_keys.HeartbeatKeys.loads) and parse in about two microseconds, not one full
heartbeat message per worker:
  [1, worker_id, seq, sent_at_s, static_digest, running, waiting, kv_cache_usage,
   ttft_ms, itl_ms, e2e_ms, prefill_tokens_per_s, decode_tokens_per_s]
followed, when signed, by key_id and signature (worker.signing.HeartbeatSigner.
signed_record). `static_digest` names the rest of the heartbeat (`static_digest`): a
router applies a record only onto the full heartbeat it was taken with. Its items have
the same limits as the Heartbeat model's fields (worker.schema).
"""

from __future__ import annotations

import json
import zlib
from typing import Any, NamedTuple, NewType

from pydantic_core import ErrorDetails, SchemaValidator, ValidationError, core_schema

from worker.schema import (
    DIGEST_SCHEMA,
    KV_USAGE_SCHEMA,
    LATENCY_SCHEMA,
    MALFORMED_JSON,
    MAX_RECORD_BYTES,
    ORDER_SCHEMA,
    OVERSIZE,
    RATE_SCHEMA,
    SENT_AT_SCHEMA,
    SEQS_SCHEMA,
    Heartbeat,
    Refused,
    exact_version,
)

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
    exact_version(LOAD_RECORD_VERSION),
    core_schema.str_schema(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:@-]+$",
                           strict=True),  # worker id, as in Heartbeat
    ORDER_SCHEMA, SENT_AT_SCHEMA, DIGEST_SCHEMA,  # seq, sent_at_s, digest
    SEQS_SCHEMA, SEQS_SCHEMA,  # running, waiting
    core_schema.nullable_schema(KV_USAGE_SCHEMA),
    *(core_schema.nullable_schema(LATENCY_SCHEMA) for _ in range(3)),  # ttft, itl, e2e (ms)
    *(core_schema.nullable_schema(RATE_SCHEMA) for _ in range(2)),  # prefill, decode tokens/s
]
_RECORD = SchemaValidator(core_schema.tuple_schema(_RECORD_ITEMS))
_SIGNED_RECORD = SchemaValidator(core_schema.tuple_schema([
    *_RECORD_ITEMS,
    core_schema.str_schema(max_length=64, pattern=r"^[A-Za-z0-9._-]+$", strict=True),  # key id
    core_schema.str_schema(max_length=128, pattern=r"^[0-9a-f]+$", strict=True)]))  # HMAC
_RECORD_ITEM_NAMES = ("version", *LoadRecord._fields)
# Every reason a Refused from record_items can carry.
RECORD_REFUSALS = frozenset({
    MALFORMED_JSON, OVERSIZE, "invalid:load_record",
    *(f"invalid:load_record.{name}" for name in _RECORD_ITEM_NAMES)})


def static_digest(heartbeat: Heartbeat) -> int:
    """A CRC-32 of everything in `heartbeat` a load record does not carry (identity,
    state, models, capacity, engine, TTL, signing key): equal digests, same worker. Of
    `engine.stuck_for_s`, only whether it is set (its value grows with every beat of a
    stuck engine; routers take it from the heartbeat that said so), and nothing while it
    is not: digests of heartbeats without it are those of the routers before it."""
    capacity, engine = heartbeat.capacity, heartbeat.engine
    stuck = "" if engine.stuck_for_s is None else "\x1fstuck"
    text = stuck + "\x1f".join((
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
