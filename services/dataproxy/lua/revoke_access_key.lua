-- Revokes an issued admin or trainer key: its digest leaves the set of valid keys and a
-- tombstone records it, in one step (no replica accepts it after this returns).
-- KEYS[1] issued-keys hash (digest → JSON {key_id, kind, label, created_at}), KEYS[2] tombstone
-- ARGV[1] digest, ARGV[2] now
-- Returns {status, key_id, kind}: revoked | already | unknown.
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then
  local tomb = redis.call('HMGET', KEYS[2], 'key_id', 'kind')
  if tomb[1] then
    return {'already', tomb[1], tomb[2]}
  end
  return {'unknown', '', ''}
end
local info = cjson.decode(raw)
redis.call('HSET', KEYS[2], 'key_id', info.key_id, 'kind', info.kind, 'revoked_at', ARGV[2])
redis.call('HDEL', KEYS[1], ARGV[1])
return {'revoked', info.key_id, info.kind}
