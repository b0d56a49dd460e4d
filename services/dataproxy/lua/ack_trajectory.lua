-- XACK and the `consumed` counter move together, in one round trip.
local n = redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, 2))
if n > 0 then redis.call('HINCRBY', KEYS[2], 'consumed', n) end
return n
