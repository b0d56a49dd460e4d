if redis.call('EXISTS', KEYS[1]) == 0 then return {'unknown_key', 0} end
local holder = redis.call('GET', KEYS[2])
if holder == false or holder == ARGV[1] then
  redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
  return {'granted', 0}
end
return {'held', redis.call('PTTL', KEYS[2])}
