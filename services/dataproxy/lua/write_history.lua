-- One snapshot per interval over all replicas: whoever moves the slot first writes it.
local slot = tonumber(ARGV[1])
if tonumber(redis.call('GET', KEYS[2]) or '-1') >= slot then return 0 end
redis.call('SET', KEYS[2], ARGV[1])
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[4])
return 1
