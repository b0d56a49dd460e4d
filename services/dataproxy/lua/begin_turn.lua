-- Admits a turn unless submission is paused, registering its in-flight lease.
-- KEYS[1] paused flag, KEYS[2] in-flight zset (token → lease deadline), KEYS[3] weight version
-- ARGV: token, lease deadline, now
-- Returns {status, weight_version}: ok | paused.
if redis.call('EXISTS', KEYS[1]) == 1 then
  return {'paused', 0}
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[3])
redis.call('ZADD', KEYS[2], tonumber(ARGV[2]), ARGV[1])
return {'ok', tonumber(redis.call('GET', KEYS[3]) or '0')}
