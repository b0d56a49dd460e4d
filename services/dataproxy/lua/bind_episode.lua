-- Binds a new active episode to a key: a new key ("new") or an idle known key ("next").
-- KEYS[1] key hash, KEYS[2] the new episode's hash
-- ARGV: mode, key_id, task_id, episode, trajectory_id, now
-- Returns {status, epoch}: ok | exists (new: the key hash is taken) | unknown | busy.
-- A retry of a call that already succeeded finds its own episode bound and returns ok.
local key = redis.call('HMGET', KEYS[1], 'state', 'episode', 'epoch')
if key[1] and key[1] == 'active' and key[2] == ARGV[4] then
  return {'ok', tonumber(key[3])}
end
if ARGV[1] == 'new' then
  if key[1] then
    return {'exists', 0}
  end
else
  if not key[1] then
    return {'unknown', 0}
  end
  if key[1] == 'active' then
    return {'busy', 0}
  end
end
local epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
redis.call('HSET', KEYS[1], 'key_id', ARGV[2], 'task_id', ARGV[3], 'state', 'active',
  'episode', ARGV[4])
if ARGV[1] == 'new' then
  redis.call('HSET', KEYS[1], 'created_at', ARGV[6])
end
redis.call('HSET', KEYS[2], 'session_id', ARGV[4], 'task_id', ARGV[3], 'epoch', epoch,
  'state', 'active', 'trajectory_id', ARGV[5], 'started_at', ARGV[6],
  'last_active_at', ARGV[6], 'turns', 0, 'last_interaction', '')
return {'ok', epoch}
