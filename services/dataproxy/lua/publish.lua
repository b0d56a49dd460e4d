-- Ends the key's active episode: publishes its trajectory (or marks it empty) and unbinds
-- the key. Idempotent: a retry finds the episode ended and returns what was stored.
-- KEYS[1] key hash, KEYS[2] episode hash, KEYS[3] turns, KEYS[4] rewards, KEYS[5] index,
-- KEYS[6] trajectories stream, KEYS[7] stats hash
-- ARGV: episode, epoch, expected turn count, trajectory_id, codec, data, now, end_reason,
-- ttl_s of the ended episode's hash
-- Returns {status, stream_id, trajectory_id, turns}: published | empty (both also for a
-- retry) | missing | stale (not the key's active episode) | retry (the turn count changed).
local ep_state = redis.call('HGET', KEYS[2], 'state')
if not ep_state then
  return {'missing', '', '', 0}
end
if ep_state == 'published' or ep_state == 'empty' then
  local ep = redis.call('HMGET', KEYS[2], 'stream_id', 'trajectory_id', 'turns')
  local trajectory_id = ep[2] or ''
  if ep_state == 'empty' then
    trajectory_id = ''
  end
  return {ep_state, ep[1] or '', trajectory_id, tonumber(ep[3] or '0')}
end
local key = redis.call('HMGET', KEYS[1], 'state', 'episode', 'epoch')
if ep_state ~= 'active' or key[1] ~= 'active' or key[2] ~= ARGV[1] or key[3] ~= ARGV[2] then
  return {'stale', '', '', 0}
end
local turns = redis.call('LLEN', KEYS[3])
if turns ~= tonumber(ARGV[3]) then
  return {'retry', '', '', turns}
end
local status = 'empty'
local stream_id = ''
local trajectory_id = ''
if turns == 0 then
  redis.call('HINCRBY', KEYS[7], 'empty_episodes', 1)
else
  status = 'published'
  trajectory_id = ARGV[4]
  stream_id = redis.call('XADD', KEYS[6], '*', 'trajectory_id', ARGV[4], 'codec', ARGV[5],
    'data', ARGV[6])
  redis.call('HINCRBY', KEYS[7], 'published', 1)
end
redis.call('HSET', KEYS[2], 'state', status, 'stream_id', stream_id, 'turns', turns,
  'ended_at', ARGV[7], 'end_reason', ARGV[8])
redis.call('HSET', KEYS[1], 'state', 'idle', 'episode', '')
redis.call('UNLINK', KEYS[3], KEYS[4], KEYS[5])
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[9]))
return {status, stream_id, trajectory_id, turns}
