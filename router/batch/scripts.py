"""The Lua scripts that change a batch's line state atomically (router.batch.state): one
batch's keys share a hash tag, so each script touches one slot."""

# Claim a chunk: leases that ended go back to the front of `todo` first.
# KEYS: batch, todo, leases, holders. ARGV: lease ms, holder.
# -> {status, chunk or -1, leases still held}
CLAIM = """
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'in_progress' then
  return {status or '', -1, redis.call('ZCARD', KEYS[3])}
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ended = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now)
for _, chunk in ipairs(ended) do
  redis.call('ZREM', KEYS[3], chunk)
  redis.call('HDEL', KEYS[4], chunk)
  redis.call('LPUSH', KEYS[2], chunk)
end
if #ended > 0 then redis.call('HINCRBY', KEYS[1], 'takeovers', #ended) end
local chunk = redis.call('LPOP', KEYS[2])
if not chunk then return {status, -1, redis.call('ZCARD', KEYS[3])} end
redis.call('ZADD', KEYS[3], now + tonumber(ARGV[1]), chunk)
redis.call('HSET', KEYS[4], chunk, ARGV[2])
return {status, tonumber(chunk), redis.call('ZCARD', KEYS[3])}
"""

# Renew a held lease. KEYS: batch, leases, holders. ARGV: chunk, lease ms, holder.
# -> {status, 1 if still held (and renewed) else 0}
RENEW = """
local status = redis.call('HGET', KEYS[1], 'status') or ''
if redis.call('HGET', KEYS[3], ARGV[1]) ~= ARGV[3] then return {status, 0} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[2], 'XX', now + tonumber(ARGV[2]), ARGV[1])
return {status, 1}
"""

# The leases that have not ended, by Redis's clock (as CLAIM and RENEW set them), not by
# the asking replica's, which may differ. KEYS: leases. -> count
LEASES_HELD = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return redis.call('ZCOUNT', KEYS[1], now, '+inf')
"""

# Give a lease back. KEYS: leases, holders. ARGV: chunk, holder.
RELEASE = """
if redis.call('HGET', KEYS[2], ARGV[1]) == ARGV[2] then
  redis.call('HDEL', KEYS[2], ARGV[1])
  redis.call('ZREM', KEYS[1], ARGV[1])
  return 1
end
return 0
"""

# Record a line's result, once, unless the finalizer has sealed the batch (it read the
# results already), or the batch is gone (-1: Redis lost it, or it was emptied; nothing
# is written, which would leave keys no scan finds). KEYS: batch, results. ARGV: index,
# line, count field.
RECORD = """
if redis.call('HEXISTS', KEYS[1], 'doc') == 0 then
  return -1
end
if redis.call('HEXISTS', KEYS[1], 'sealed') == 1 then
  redis.call('HINCRBY', KEYS[1], 'reruns', 1)
  return 0
end
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2]) == 1 then
  redis.call('HINCRBY', KEYS[1], ARGV[3], 1)
  return 1
end
redis.call('HINCRBY', KEYS[1], 'reruns', 1)
return 0
"""

# Move to `to` (setting `<to>_at` and `end`) if the status is one of ARGV[4..].
# KEYS: batch, todo. ARGV: to, now, end ('' keeps it), from...; clears todo when ending.
MOVE = """
local status = redis.call('HGET', KEYS[1], 'status')
for i = 4, #ARGV do
  if status == ARGV[i] then
    redis.call('HSET', KEYS[1], 'status', ARGV[1], ARGV[1] .. '_at', ARGV[2])
    if ARGV[3] ~= '' then
      redis.call('HSET', KEYS[1], 'end', ARGV[3])
      redis.call('DEL', KEYS[2])
    end
    return 1
  end
end
return 0
"""
