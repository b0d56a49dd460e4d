-- Claims due members of a deadline zset: each is pushed `lease_s` ahead, so another replica's
-- reaper does not take it too; the claimer ends it (which removes it) or it comes due again.
-- KEYS[1] zset; ARGV: now, lease_s, limit. Returns the claimed members.
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))
local until_ = tonumber(ARGV[1]) + tonumber(ARGV[2])
for _, member in ipairs(due) do
  redis.call('ZADD', KEYS[1], until_, member)
end
return due
