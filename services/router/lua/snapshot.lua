-- The workers with their live session counts, and (Route only, when KEYS[4] is given) the
-- session's affinity, refreshed: its expiry and its last use in its worker's session set.
-- Each worker's set `ARGV[1] .. worker_id` loses the sessions unused for the affinity TTL
-- (their affinities have expired), so its size counts the live affinities naming the worker.
-- First, workers whose last heartbeat is older than ARGV[4] (unix time: the router's clock,
-- the one that stamps heartbeats) leave the registry, as a deregistration would remove them;
-- their ids come back as the sixth element.
-- Milliseconds on Redis's clock, the one that also expires the affinities, so every router
-- agrees on which sessions are still live.
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local forgotten = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '(' .. ARGV[4])
for _, id in ipairs(forgotten) do
  redis.call('HDEL', KEYS[1], id)
  redis.call('ZREM', KEYS[2], id)
  redis.call('HDEL', KEYS[3], id)
  redis.call('DEL', ARGV[1] .. id)
end
local ttl_ms = tonumber(ARGV[2])
local current = ''
if KEYS[4] then
  current = redis.call('GET', KEYS[4]) or ''
  if current ~= '' then
    redis.call('PEXPIRE', KEYS[4], ttl_ms)
    if redis.call('HEXISTS', KEYS[1], current) == 1 then
      redis.call('ZADD', ARGV[1] .. current, string.format('%d', now_ms), ARGV[3])
    end
  end
end
local workers = redis.call('HGETALL', KEYS[1])
local counts = {}
local cutoff = string.format('%d', now_ms - ttl_ms)
for i = 1, #workers, 2 do
  local set = ARGV[1] .. workers[i]
  redis.call('ZREMRANGEBYSCORE', set, '-inf', cutoff)
  counts[#counts + 1] = workers[i]
  counts[#counts + 1] = redis.call('ZCARD', set)
end
return {current, workers, redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES'),
        redis.call('HGETALL', KEYS[3]), counts, forgotten}
