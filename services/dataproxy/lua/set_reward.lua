-- Stores the reward of one interaction (last write wins) of the key's active episode
-- (mode 'active'), of a header-mode session's active episode (mode 'episode': the episode
-- hash says whether it is active) or of an ended episode held for its reward (mode 'held').
-- KEYS[1] key hash, KEYS[2] episode hash, KEYS[3] rewards hash, KEYS[4] interaction index
-- ARGV: episode, epoch, interaction_id ('' = the last completed one), reward, mode
-- Returns {status, interaction_id, is_last}: ok | not_active | no_interaction | not_found.
local ep = redis.call('HMGET', KEYS[2], 'state', 'epoch', 'last_interaction')
if ARGV[5] == 'held' then
  if ep[1] ~= 'ended_awaiting_reward' or ep[2] ~= ARGV[2] then
    return {'not_active', '', 0}
  end
elseif ARGV[5] == 'episode' then
  if ep[1] ~= 'active' or ep[2] ~= ARGV[2] then
    return {'not_active', '', 0}
  end
else
  local key = redis.call('HMGET', KEYS[1], 'state', 'episode', 'epoch')
  if key[1] ~= 'active' or key[2] ~= ARGV[1] or key[3] ~= ARGV[2] then
    return {'not_active', '', 0}
  end
end
local last = ep[3] or ''
local id = ARGV[3]
if id == '' then
  id = last
  if id == '' then
    return {'no_interaction', '', 0}
  end
elseif redis.call('HEXISTS', KEYS[4], id) == 0 then
  return {'not_found', id, 0}
end
redis.call('HSET', KEYS[3], id, ARGV[4])
local is_last = 0
if id == last then
  is_last = 1
end
return {'ok', id, is_last}
