"""Global rate limits in Redis: one atomic Lua script decides all of a request's buckets.

Every router replica runs the same script against the same keys, so a key's limit holds
across replicas. The script reads Redis's own clock (`TIME`), so replicas' clocks need
not agree. All buckets of one request are decided together: if any is over its limit none
is charged. Keys expire once their bucket is full again, so idle keys cost nothing.

Bucket keys share a `{hash tag}` (the tenant), so the script also runs on Redis Cluster.
"""

from __future__ import annotations

from collections.abc import Sequence

from redis.asyncio import Redis

from router.admission.gcra import Bucket, BucketState, RateDecision, state_after

# KEYS[i]: bucket i. ARGV: per bucket (interval_us, capacity_us, cost).
# Returns {allowed, ahead_us_1, retry_after_us_1, ahead_us_2, ...}: `ahead` is tat - now
# after the decision (the bucket's fill), `retry_after` when that bucket would fit. A
# stored value that is not a number, or not a string (a hash where the bucket should be),
# is an empty bucket; one past the bucket's capacity, a full one.
GCRA_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local allowed = 1
local base = {}
local new_tat = {}
for i = 1, #KEYS do
  local interval = tonumber(ARGV[i * 3 - 2])
  local capacity = tonumber(ARGV[i * 3 - 1])
  local cost = tonumber(ARGV[i * 3])
  local stored = redis.pcall('GET', KEYS[i])
  local tat = now
  if type(stored) == 'string' then tat = tonumber(stored) or now end
  if tat ~= tat or tat < now then tat = now end
  -- A bucket is never further ahead than its capacity: a value beyond it (written by
  -- someone else) is taken as full and rewritten, so it costs one refill, not forever.
  if tat > now + capacity then
    tat = now + capacity
    redis.call('SET', KEYS[i], string.format('%.0f', tat), 'PX',
               math.ceil(capacity / 1000) + 1000)
  end
  base[i] = tat
  new_tat[i] = tat + cost * interval
  if new_tat[i] - capacity > now then allowed = 0 end
end
local out = {allowed}
for i = 1, #KEYS do
  local capacity = tonumber(ARGV[i * 3 - 1])
  if allowed == 1 then
    local ttl_ms = math.ceil((new_tat[i] - now) / 1000) + 1000
    redis.call('SET', KEYS[i], string.format('%.0f', new_tat[i]), 'PX', ttl_ms)
    out[#out + 1] = math.floor(new_tat[i] - now)
    out[#out + 1] = 0
  else
    out[#out + 1] = math.floor(base[i] - now)
    out[#out + 1] = math.max(0, math.ceil(new_tat[i] - capacity - now))
  end
end
return out
"""


class RateLimitKeys:
    """The one place that names rate-limit keys in Redis."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def bucket(self, tenant: str, bucket: Bucket) -> str:
        return f"{self.prefix}:rl:{{{tenant}}}:{bucket.name}"


class RedisLimiter:
    """Runs the GCRA script. Raises redis errors / OSError; the caller bounds the wait."""

    def __init__(self, redis: Redis, keys: RateLimitKeys) -> None:
        self._redis = redis
        self._keys = keys
        self._script = redis.register_script(GCRA_LUA)

    async def aclose(self) -> None:
        await self._redis.aclose()

    async def warm_up(self) -> None:
        """Open a connection and load the script, so the first request pays for neither
        (a TLS handshake alone can take longer than the request path waits)."""
        await self._redis.script_load(GCRA_LUA)

    async def check(self, tenant: str, buckets: Sequence[Bucket]) -> RateDecision:
        keys = [self._keys.bucket(tenant, b) for b in buckets]
        args: list[float | int] = []
        for bucket in buckets:
            args += [bucket.interval_us, bucket.capacity_us, bucket.cost]
        reply = await self._script(keys=keys, args=args)
        allowed = int(reply[0]) == 1
        states: list[BucketState] = []
        for index, bucket in enumerate(buckets):
            ahead_us = float(reply[1 + 2 * index])
            retry_us = float(reply[2 + 2 * index])
            states.append(state_after(bucket, ahead_us, retry_us))
        return RateDecision(allowed=allowed, states=tuple(states), source="redis")
