-- Ends a turn in one round trip: appends it to its episode if that is still the active one
-- (same epoch), pushes the episode's idle deadline forward, and releases the turn's in-flight
-- lease. While other turns of the episode still run, the deadline is only raised (their
-- begin_turn raised it to their leases'); the last running turn sets it to now + idle timeout.
-- The record says which weight version the turn ended at; if the version moved since
-- the caller encoded it, nothing is done and the caller re-encodes with the version returned.
-- KEYS[1] key hash, KEYS[2] episode hash, KEYS[3] turns list, KEYS[4] interaction index,
-- KEYS[5] idle zset, KEYS[6] in-flight zset, KEYS[7] weight version, KEYS[8] running-turns
-- hash ({digest}/{episode} → turns holding a lease)
-- ARGV: episode, epoch, interaction_id, msgpack turn record, now, idle deadline, idle member,
-- lease token ('' none), the record's weight_version_end (-1: not checked),
-- mode ('header': the episode hash says whether it is active; else the key hash)
-- Returns {status, index or version}: ok | duplicate (a retried append that already landed) |
-- ended | version (the weight version is now the second value; nothing was done).
-- Releases the lease and, if it was still held (not released before), the turn's count.
local function release()
  if ARGV[8] ~= '' and redis.call('ZREM', KEYS[6], ARGV[8]) == 1 then
    if redis.call('HINCRBY', KEYS[8], ARGV[7], -1) <= 0 then
      redis.call('HDEL', KEYS[8], ARGV[7])
    end
  end
end
local active
if ARGV[10] == 'header' then
  local ep = redis.call('HMGET', KEYS[2], 'state', 'epoch')
  active = ep[1] == 'active' and ep[2] == ARGV[2]
else
  local key = redis.call('HMGET', KEYS[1], 'state', 'episode', 'epoch')
  active = key[1] == 'active' and key[2] == ARGV[1] and key[3] == ARGV[2]
end
if not active then
  release()
  return {'ended', -1}
end
local expected = tonumber(ARGV[9])
if expected >= 0 then
  local version = tonumber(redis.call('GET', KEYS[7]) or '0')
  if version ~= expected then
    return {'version', version}
  end
end
release()
local existing = redis.call('HGET', KEYS[4], ARGV[3])
if existing then
  return {'duplicate', tonumber(existing)}
end
local index = redis.call('RPUSH', KEYS[3], ARGV[4]) - 1
redis.call('HSET', KEYS[4], ARGV[3], index)
redis.call('HINCRBY', KEYS[2], 'turns', 1)
redis.call('HSET', KEYS[2], 'last_interaction', ARGV[3], 'last_active_at', ARGV[5])
if tonumber(redis.call('HGET', KEYS[8], ARGV[7]) or '0') > 0 then
  redis.call('ZADD', KEYS[5], 'GT', tonumber(ARGV[6]), ARGV[7])
else
  redis.call('ZADD', KEYS[5], tonumber(ARGV[6]), ARGV[7])
end
return {'ok', index}
