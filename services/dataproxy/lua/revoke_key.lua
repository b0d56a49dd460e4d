-- Revokes a session key: replaces its key hash by a tombstone (so every later call with the
-- key is refused as revoked, and nothing can bind an episode to it) and discards its open
-- episodes — active ones and ones held for a late reward — without publishing them: their
-- turns, rewards and index are deleted, the episode hash says `revoked`, capacity is given
-- back (open_episodes), a group counts the member as done, a header-mode session's pointer
-- is cleared. The caller names the candidate episodes (found in the idle and awaiting zsets);
-- a per-episode key's own active and held episodes must be among them, else nothing is done
-- and the script asks for them. With the key already revoked it only discards candidates
-- still open (an episode bound while the revocation ran).
-- KEYS[1] key hash, KEYS[2] tombstone, KEYS[3] stats hash, KEYS[4] idle zset,
-- KEYS[5] awaiting-reward zset, KEYS[6] running-turns hash, then per candidate episode:
-- episode hash, turns, rewards, index, group hash (the stats hash when none), session
-- pointer (header mode; the stats hash otherwise).
-- ARGV[1] digest, ARGV[2] now, ARGV[3] ttl_s of the ended episode record, ARGV[4] kind to
-- record when the key has no mode ('session'), then per candidate: episode name, group_id.
-- Returns {status, key_id, kind, discarded, missing episode}: revoked | already | unknown |
-- retry (the fifth value is an episode of the key that was not among the candidates).
local key = redis.call('HMGET', KEYS[1], 'key_id', 'mode', 'state', 'episode', 'held')
local status = 'revoked'
local key_id, kind
if not key[1] then
  local tomb = redis.call('HMGET', KEYS[2], 'key_id', 'kind')
  if not tomb[1] then
    return {'unknown', '', '', 0, ''}
  end
  status, key_id, kind = 'already', tomb[1], tomb[2]
else
  key_id = key[1]
  kind = key[2] or ARGV[4]
  local named = {}
  for i = 5, #ARGV, 2 do
    named[ARGV[i]] = true
  end
  if key[3] == 'active' and key[4] and key[4] ~= '' and not named[key[4]] then
    return {'retry', key_id, kind, 0, key[4]}
  end
  if key[5] and key[5] ~= '' and not named[key[5]] then
    return {'retry', key_id, kind, 0, key[5]}
  end
  redis.call('HSET', KEYS[2], 'key_id', key_id, 'kind', kind, 'revoked_at', ARGV[2])
  redis.call('DEL', KEYS[1])
end
local discarded = 0
local c = 0
for i = 5, #ARGV, 2 do
  local name, group_id = ARGV[i], ARGV[i + 1]
  local base = 6 + 6 * c
  c = c + 1
  local ep_hash = KEYS[base + 1]
  local state = redis.call('HGET', ep_hash, 'state')
  if state == 'active' or state == 'ended_awaiting_reward' then
    local member = ARGV[1] .. '/' .. name
    redis.call('HSET', ep_hash, 'state', 'revoked', 'ended_at', ARGV[2], 'end_reason', 'revoked')
    redis.call('EXPIRE', ep_hash, tonumber(ARGV[3]))
    redis.call('UNLINK', KEYS[base + 2], KEYS[base + 3], KEYS[base + 4])
    redis.call('ZREM', KEYS[4], member)
    redis.call('ZREM', KEYS[5], member)
    redis.call('HDEL', KEYS[6], member)
    -- (an episode bound before this counter existed must not drive it below zero)
    if tonumber(redis.call('HGET', KEYS[3], 'open_episodes') or '0') > 0 then
      redis.call('HINCRBY', KEYS[3], 'open_episodes', -1)
    end
    redis.call('HINCRBY', KEYS[3], 'revoked_episodes', 1)
    if group_id ~= '' then
      redis.call('HINCRBY', KEYS[base + 5], 'done', 1)
    end
    if kind == 'header' and redis.call('HGET', KEYS[base + 6], 'episode') == name then
      redis.call('HSET', KEYS[base + 6], 'episode', '', 'last', name)
      redis.call('EXPIRE', KEYS[base + 6], tonumber(ARGV[3]))
    end
    discarded = discarded + 1
  end
end
return {status, key_id, kind, discarded, ''}
