-- KEYS: key hash, run claim. ARGV: run id, ttl_ms.
if redis.call('EXISTS', KEYS[1]) == 0 then return {'unknown_key', ''} end
if redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then return {'claimed', ARGV[1]} end
return {'taken', redis.call('GET', KEYS[2])}
