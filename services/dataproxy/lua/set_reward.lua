-- Stores the reward of one interaction of the key's active episode (last write wins).
-- KEYS[1] key hash, KEYS[2] episode hash, KEYS[3] rewards hash, KEYS[4] interaction index
-- ARGV: episode, epoch, interaction_id ('' = the last completed one), reward
-- Returns {status, interaction_id}: ok | not_active | no_interaction | not_found.
local key = redis.call('HMGET', KEYS[1], 'state', 'episode', 'epoch')
if key[1] ~= 'active' or key[2] ~= ARGV[1] or key[3] ~= ARGV[2] then
  return {'not_active', ''}
end
local id = ARGV[3]
if id == '' then
  id = redis.call('HGET', KEYS[2], 'last_interaction') or ''
  if id == '' then
    return {'no_interaction', ''}
  end
elseif redis.call('HEXISTS', KEYS[4], id) == 0 then
  return {'not_found', id}
end
redis.call('HSET', KEYS[3], id, ARGV[4])
return {'ok', id}
