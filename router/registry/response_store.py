"""Which worker holds each stored response of the Responses API, shared through Redis.

vLLM keeps the responses it stores (`store: true`, the default) in its own memory: a
follow-up (`previous_response_id`), a retrieval (`GET /v1/responses/{id}`) or a cancel
must reach the worker that answered, from whichever replica and region the client calls
next. When a replica passes a stored response on, it writes one key:

    <prefix>:response:<response id>  ->  {"w": worker, "r": region, "m": model,
                                          "o": owner, "k": key id, "s": signature}

with a TTL (`router.responses.ttl_s`). `o` is the API key's tenant (None without keys): a
response is found only by its own tenant, and anyone else is told it does not exist.
Where heartbeats are signed the record is too (HMAC-SHA256 with the router's heartbeat
key, over the id and every field), so that whoever can write to Redis cannot move a
conversation to another worker or give it another owner; a record that does not verify
is not believed (and counted).

Each replica also remembers the responses it recorded itself (the newest
`LOCAL_ENTRIES`), so that its own clients' follow-ups never wait on Redis and survive a
Redis that is down or restarted empty. A record that cannot be written is kept there
only, counted and logged; a lookup that cannot reach Redis raises StoreUnavailable (the
client is told to retry, not that the response is gone).
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

from redis.asyncio import Redis
from redis.exceptions import RedisError

from worker.redis_client import raise_if_cancelling
from worker.signing import hmac_sha256_hex

log = logging.getLogger("globalpool.responses")

LOCAL_ENTRIES = 50_000  # ~10 MB at most; a replica's own recent responses
MAX_RECORD_BYTES = 2048  # a record is ~200 bytes; anything larger is not ours


@dataclass(frozen=True, slots=True)
class ResponseHolder:
    """Where a stored response lives, and whose it is."""

    worker_id: str
    region: str
    model: str
    owner: str | None  # the tenant of the API key that created it (None: no keys)


class StoreUnavailable(Exception):
    """Redis could not be asked; the response may well exist."""


@dataclass
class ResponseStats:
    """Counters for /metrics (`globalpool_responses_recorded`, `..._lookups`).

    `recorded[outcome]`: "stored"; "local_only" (Redis refused the write: only this
    replica can find it); "no_id" (the answer named no response id).
    `lookups[outcome]`: "found"; "unknown" (no record: never stored here, expired, or
    Redis lost it); "other_tenant"; "forged" (a record that does not verify);
    "worker_gone" (its worker left the fleet); "worker_forgot" (its worker answered
    404: restarted, or evicted it); "store_unavailable" (Redis unreachable).
    """

    recorded: Counter[str] = field(default_factory=Counter)
    lookups: Counter[str] = field(default_factory=Counter)


class ResponseStore:
    """Records and finds the holders of stored responses (see the module doc)."""

    def __init__(self, redis: Redis, prefix: str, *, ttl_s: float,
                 keys: Mapping[str, bytes], signing_key_id: str | None = None,
                 stats: ResponseStats | None = None,
                 local_entries: int = LOCAL_ENTRIES) -> None:
        """`keys`: the heartbeat keys ({} when heartbeats are not signed): records are
        signed with `signing_key_id` (else the first) and must verify with one of them."""
        self._redis = redis
        self._prefix = f"{prefix}:response:"
        self.ttl_s = ttl_s
        self._keys = dict(keys)
        self._key_id = (signing_key_id if signing_key_id in self._keys
                        else next(iter(self._keys), None))
        self.stats = stats or ResponseStats()
        self._local: OrderedDict[str, tuple[ResponseHolder, float]] = OrderedDict()
        self._local_entries = local_entries

    def key(self, response_id: str) -> str:
        return self._prefix + response_id

    async def record(self, response_id: str, holder: ResponseHolder) -> None:
        """Remember that `holder` has `response_id`: here at once, then in Redis (a
        failure there is counted and logged, never raised)."""
        self._remember(response_id, holder)
        try:
            await self._redis.set(self.key(response_id), self.encode(response_id, holder),
                                  px=max(1, round(self.ttl_s * 1000)))
        except (RedisError, OSError) as exc:
            raise_if_cancelling()
            self.stats.recorded["local_only"] += 1
            log.warning("response %s: its holder is known to this replica only (Redis: %s)",
                        response_id, exc)
            return
        self.stats.recorded["stored"] += 1

    async def lookup(self, response_id: str, owner: str | None) -> ResponseHolder | None:
        """The holder of `response_id` if it exists for `owner`, else None (counted by
        why). Raises StoreUnavailable when Redis cannot be asked."""
        holder = self._recalled(response_id)
        if holder is None:
            try:
                raw = await self._redis.get(self.key(response_id))
            except (RedisError, OSError) as exc:
                raise_if_cancelling()
                self.stats.lookups["store_unavailable"] += 1
                raise StoreUnavailable(str(exc)) from None
            if raw is None:
                self.stats.lookups["unknown"] += 1
                return None
            holder = self.decode(response_id, raw)
            if holder is None:
                self.stats.lookups["forged"] += 1
                log.warning("response %s: its record in Redis does not verify; not believed",
                            response_id)
                return None
        if holder.owner != owner:
            self.stats.lookups["other_tenant"] += 1
            return None
        return holder  # (counted "found" by the caller, once its worker is live)

    def encode(self, response_id: str, holder: ResponseHolder) -> bytes:
        fields: dict[str, str | None] = {"w": holder.worker_id, "r": holder.region,
                                         "m": holder.model, "o": holder.owner}
        if self._key_id is not None:
            fields["k"] = self._key_id
            fields["s"] = hmac_sha256_hex(self._keys[self._key_id],
                                          _signed_bytes(response_id, fields))
        return json.dumps(fields, separators=(",", ":")).encode()

    def decode(self, response_id: str, raw: bytes | str) -> ResponseHolder | None:
        """The holder in a record, if it is well formed and (where records are signed)
        signed by one of the keys; else None."""
        if len(raw) > MAX_RECORD_BYTES:
            return None
        try:
            fields = json.loads(raw)
        except (ValueError, RecursionError):  # (JSON nested deeper than Python recurses)
            return None
        if not isinstance(fields, dict):
            return None
        worker, region, model, owner = (fields.get(name) for name in "wrmo")
        if not (isinstance(worker, str) and isinstance(region, str) and isinstance(model, str)
                and (owner is None or isinstance(owner, str))):
            return None
        if self._keys and not self._verified(response_id, fields):
            return None
        return ResponseHolder(worker, region, model, owner)

    def _verified(self, response_id: str, fields: dict[str, object]) -> bool:
        key_id, signature = fields.get("k"), fields.get("s")
        secret = self._keys.get(key_id) if isinstance(key_id, str) else None
        if secret is None or not isinstance(signature, str):
            return False
        signed = {name: fields.get(name) for name in ("w", "r", "m", "o", "k")}
        expected = hmac_sha256_hex(secret, _signed_bytes(response_id, signed))
        return hmac.compare_digest(expected.encode(), signature.encode())

    def _remember(self, response_id: str, holder: ResponseHolder) -> None:
        local = self._local
        local[response_id] = (holder, time.monotonic() + self.ttl_s)
        local.move_to_end(response_id)
        while len(local) > self._local_entries:
            local.popitem(last=False)

    def _recalled(self, response_id: str) -> ResponseHolder | None:
        entry = self._local.get(response_id)
        if entry is None:
            return None
        if entry[1] < time.monotonic():
            del self._local[response_id]
            return None
        return entry[0]


def _signed_bytes(response_id: str, fields: Mapping[str, object]) -> bytes:
    """What a record's signature covers: its response id and fields, canonically."""
    return json.dumps([response_id, *(fields.get(name) for name in ("w", "r", "m", "o", "k"))],
                      separators=(",", ":"), ensure_ascii=True).encode()
