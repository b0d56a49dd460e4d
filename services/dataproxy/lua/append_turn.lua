-- Appends one completed turn to the key's active episode, if it is still that episode, and
-- pushes the episode's idle deadline forward.
-- KEYS[1] key hash, KEYS[2] episode hash, KEYS[3] turns list, KEYS[4] interaction index,
-- KEYS[5] idle zset
-- ARGV: episode, epoch, interaction_id, msgpack turn record, now, idle deadline, idle member
-- Returns {status, index}: ok | duplicate (a retried append that already landed) | ended.
local key = redis.call('HMGET', KEYS[1], 'state', 'episode', 'epoch')
if key[1] ~= 'active' or key[2] ~= ARGV[1] or key[3] ~= ARGV[2] then
  return {'ended', -1}
end
local existing = redis.call('HGET', KEYS[4], ARGV[3])
if existing then
  return {'duplicate', tonumber(existing)}
end
local index = redis.call('RPUSH', KEYS[3], ARGV[4]) - 1
redis.call('HSET', KEYS[4], ARGV[3], index)
redis.call('HINCRBY', KEYS[2], 'turns', 1)
redis.call('HSET', KEYS[2], 'last_interaction', ARGV[3], 'last_active_at', ARGV[5])
redis.call('ZADD', KEYS[5], tonumber(ARGV[6]), ARGV[7])
return {'ok', index}
