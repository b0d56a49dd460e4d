if redis.call('EXISTS', KEYS[1]) == 0 then return {'unknown_key'} end
local r = redis.call('HMGET', KEYS[2], 'response', 'chain', 'chain_len')
if r[1] == false then return {'not_found'} end
local out = {'ok', r[1]}
if ARGV[1] == '1' then
  for _, item in ipairs(redis.call('LRANGE', r[2], 0, tonumber(r[3]) - 1)) do
    out[#out + 1] = item
  end
end
return out
