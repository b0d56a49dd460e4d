-- KEYS: key hash, new response hash, parent response hash, new chain list.
-- ARGV: parent id, ttl_s, response json, items...
-- `unpack` is bounded by the C stack, so pushes go in batches.
local function push_all(key, items, from)
  local n = redis.call('LLEN', key)
  for i = from, #items, 500 do
    n = redis.call('RPUSH', key, unpack(items, i, math.min(i + 499, #items)))
  end
  return n
end

if redis.call('EXISTS', KEYS[1]) == 0 then return {'unknown_key', 0} end
local chain = KEYS[4]
if ARGV[1] ~= '' then
  local parent = redis.call('HMGET', KEYS[3], 'chain', 'chain_len')
  if parent[1] == false then return {'parent_not_found', 0} end
  local parent_len = tonumber(parent[2])
  if redis.call('LLEN', parent[1]) == parent_len then
    chain = parent[1]
  else
    redis.call('DEL', chain)
    push_all(chain, redis.call('LRANGE', parent[1], 0, parent_len - 1), 1)
  end
end
local n = push_all(chain, ARGV, 4)
redis.call('HSET', KEYS[2], 'response', ARGV[3], 'parent', ARGV[1], 'chain', chain,
  'chain_len', n)
redis.call('EXPIRE', KEYS[2], ARGV[2])
redis.call('EXPIRE', chain, ARGV[2])
return {'ok', n}
