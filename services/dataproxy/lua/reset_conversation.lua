if redis.call('EXISTS', KEYS[1]) == 0 then return {'unknown_key', 0} end
local n = redis.call('LLEN', KEYS[2])
redis.call('DEL', KEYS[2])
return {'ok', n}
