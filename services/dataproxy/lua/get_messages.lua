if redis.call('EXISTS', KEYS[1]) == 0 then return {'unknown_key', 0} end
local total = redis.call('LLEN', KEYS[2])
local limit = tonumber(ARGV[1])
local start = 0
if limit > 0 and total > limit then start = total - limit end
local out = {'ok', total}
for _, m in ipairs(redis.call('LRANGE', KEYS[2], start, -1)) do out[#out + 1] = m end
return out
