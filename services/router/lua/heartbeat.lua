-- Records the heartbeat only for a registered worker, so a deregistered (or flushed) one
-- learns that it must register again instead of reappearing half-known.
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
return 1
