"""The versioned heartbeat: the one contract between worker agents and routers.

A worker agent publishes a `Heartbeat` to Redis every interval; routers read it. This is
the one module of `worker` that `router` imports. `HeartbeatKeys` is the one place that
knows the Redis key and channel names.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

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

    - `worker(id)`: a string key holding the heartbeat JSON, with a TTL of `ttl_s`.
    - `channel`: pub/sub channel; each message is a heartbeat JSON, or `gone:<worker_id>`
      when a worker removes itself (drain finished).
    """

    GONE_PREFIX = "gone:"

    def __init__(self, prefix: str = "globalpool") -> None:
        self.prefix = prefix
        self.channel = f"{prefix}:heartbeats"
        self.pattern = f"{prefix}:hb:*"

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}:hb:{worker_id}"

    def gone_message(self, worker_id: str) -> str:
        return f"{self.GONE_PREFIX}{worker_id}"
