-- Releases a turn that ends without its append: drops its in-flight lease and, if the lease
-- was still held (not released before), its count among its episode's running turns.
-- KEYS[1] in-flight zset, KEYS[2] running-turns hash ({digest}/{episode} → turns holding a lease)
-- ARGV: lease token, the episode's member ('' when unknown). Returns 1 if the lease was held.
if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then
  return 0
end
if ARGV[2] ~= '' and redis.call('HINCRBY', KEYS[2], ARGV[2], -1) <= 0 then
  redis.call('HDEL', KEYS[2], ARGV[2])
end
return 1
