-- `unpack` is bounded by the C stack, so pushes go in batches.
local function push_all(key, items, from)
  local n = redis.call('LLEN', key)
  for i = from, #items, 500 do
    n = redis.call('RPUSH', key, unpack(items, i, math.min(i + 499, #items)))
  end
  return n
end

if redis.call('EXISTS', KEYS[1]) == 0 then return {'unknown_key', 0} end
if ARGV[1] ~= '' and redis.call('GET', KEYS[3]) ~= ARGV[1] then return {'not_holder', 0} end
local n = push_all(KEYS[2], ARGV, 3)
if n > 0 then redis.call('EXPIRE', KEYS[2], ARGV[2]) end
return {'ok', n}
