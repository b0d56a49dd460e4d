-- Ends an episode: publishes its trajectory (or marks it empty), or holds it for a late
-- reward; unbinds the key. Idempotent: a retry finds the episode ended and returns what was
-- stored. A held episode (`ended_awaiting_reward`) is published later by this same script.
-- KEYS[1] key hash, KEYS[2] episode hash, KEYS[3] turns, KEYS[4] rewards, KEYS[5] index,
-- KEYS[6] trajectories stream, KEYS[7] stats hash, KEYS[8] idle zset, KEYS[9] awaiting zset,
-- KEYS[10] trajectory's group record, KEYS[11] group hash (unused without a group),
-- KEYS[12] the session pointer hash (header mode; unused otherwise), KEYS[13] running-turns
-- hash (the episode's count is dropped: its turns still running find it ended),
-- KEYS[14] the list of recent trajectory summaries (the console's)
-- ARGV[1] episode, ARGV[2] epoch, ARGV[3] expected turn count, ARGV[4] trajectory_id,
-- ARGV[5] codec, ARGV[6] data ('' when the caller wants a hold), ARGV[7] now,
-- ARGV[8] end_reason, ARGV[9] ttl_s of ended records, ARGV[10] zset member,
-- ARGV[11] interactions, ARGV[12] joined interactions, ARGV[13] hold deadline (0: publish),
-- ARGV[14] group_id, ARGV[15] group_size, ARGV[16] mode ('header': the episode hash says
-- whether it is active, and ending it clears the session pointer; else the key hash, which
-- also remembers this last publication: last_episode, last_status, last_trajectory_id,
-- last_stream_id, last_turns, last_ended_at, so a retried end_session finds it),
-- ARGV[17] the trajectory's summary, JSON ('' or absent: none), ARGV[18] summaries kept
-- Returns {status, stream_id, trajectory_id, turns}: published | empty (both also for a
-- retry) | held | missing | stale (not the key's active episode) | retry (re-read: a turn or
-- a reward landed since the caller read the episode).
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
local held = ep_state == 'ended_awaiting_reward'
if held then
  if redis.call('HGET', KEYS[2], 'epoch') ~= ARGV[2] then
    return {'stale', '', '', 0}
  end
elseif ARGV[16] == 'header' then
  if ep_state ~= 'active' or redis.call('HGET', KEYS[2], 'epoch') ~= ARGV[2] then
    return {'stale', '', '', 0}
  end
else
  local key = redis.call('HMGET', KEYS[1], 'state', 'episode', 'epoch')
  if ep_state ~= 'active' or key[1] ~= 'active' or key[2] ~= ARGV[1] or key[3] ~= ARGV[2] then
    return {'stale', '', '', 0}
  end
end
-- Unbinds the episode from its key (or its session) and remembers how it ended.
local function unbind(status, stream_id, trajectory_id, turns, ended_at)
  if ARGV[16] == 'header' then
    if redis.call('HGET', KEYS[12], 'episode') == ARGV[1] then
      redis.call('HSET', KEYS[12], 'episode', '', 'last', ARGV[1])
      redis.call('EXPIRE', KEYS[12], tonumber(ARGV[9]))
    end
    return
  end
  if status == 'held' then
    redis.call('HSET', KEYS[1], 'state', 'idle', 'episode', '', 'held', ARGV[1])
  else
    redis.call('HSET', KEYS[1], 'state', 'idle', 'episode', '')
  end
  redis.call('HSET', KEYS[1], 'last_episode', ARGV[1], 'last_status', status,
    'last_trajectory_id', trajectory_id, 'last_stream_id', stream_id, 'last_turns', turns,
    'last_ended_at', ended_at)
end
local turns = redis.call('LLEN', KEYS[3])
if turns ~= tonumber(ARGV[3]) then
  return {'retry', '', '', turns}
end
local hold_deadline = tonumber(ARGV[13])
if hold_deadline > 0 and not held and turns > 0 then
  local last = redis.call('HGET', KEYS[2], 'last_interaction') or ''
  if redis.call('HEXISTS', KEYS[4], last) == 1 then
    return {'retry', '', '', turns}
  end
  redis.call('HSET', KEYS[2], 'state', 'ended_awaiting_reward', 'ended_at', ARGV[7],
    'end_reason', ARGV[8])
  unbind('held', '', ARGV[4], turns, ARGV[7])
  redis.call('ZREM', KEYS[8], ARGV[10])
  redis.call('HDEL', KEYS[13], ARGV[10])
  redis.call('ZADD', KEYS[9], hold_deadline, ARGV[10])
  return {'held', '', ARGV[4], turns}
end
if turns > 0 and ARGV[6] == '' then
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
  -- Entry ids are <ms>-<n>, n = the trajectory's number (`published` after this one), so a
  -- consumer group's backlog is a difference of two ids (docs/metrics.md); ms never goes
  -- backwards. The first numbered id starts after whatever the stream already holds.
  local n = redis.call('HINCRBY', KEYS[7], 'published', 1)
  local ms = math.floor(tonumber(ARGV[7]) * 1000)
  local last_ms = tonumber(redis.call('HGET', KEYS[7], 'stream_ms') or '-1')
  if last_ms < 0 then
    local top = redis.call('XREVRANGE', KEYS[6], '+', '-', 'COUNT', 1)[1]
    if top then last_ms = tonumber(string.match(top[1], '^(%d+)-')) + 1 end
  end
  if ms < last_ms then ms = last_ms end
  local added = redis.pcall('XADD', KEYS[6], string.format('%d-%d', ms, n),
    'trajectory_id', ARGV[4], 'codec', ARGV[5], 'data', ARGV[6])
  if type(added) == 'table' and added.err then
    -- Someone else wrote a later id: the entry still goes on, unnumbered.
    added = redis.call('XADD', KEYS[6], '*', 'trajectory_id', ARGV[4], 'codec', ARGV[5],
      'data', ARGV[6])
  end
  stream_id = added
  redis.call('HSET', KEYS[7], 'stream_ms', ms)
  redis.call('HINCRBY', KEYS[7], 'interactions', tonumber(ARGV[11]))
  redis.call('HINCRBY', KEYS[7], 'joined', tonumber(ARGV[12]))
  -- The console's summary of the trajectory (its counters go into the stats hash too).
  if ARGV[17] ~= nil and ARGV[17] ~= '' then
    local summary = cjson.decode(ARGV[17])
    redis.call('HINCRBY', KEYS[7], 'output_tokens', summary['output_tokens'])
    redis.call('HINCRBY', KEYS[7], 'exact_interactions', summary['exact_interactions'])
    redis.call('HINCRBY', KEYS[7], 'length_mismatches', summary['length_mismatches'])
    -- Integers only in the stats hash: rewards are summed in millionths; the positive ones
    -- and the negative ones' magnitudes apart too, as counters that never decrease.
    local reward_micros = math.floor(summary['final_reward'] * 1000000 + 0.5)
    redis.call('HINCRBY', KEYS[7], 'reward_micros', string.format('%d', reward_micros))
    if reward_micros > 0 then
      redis.call('HINCRBY', KEYS[7], 'reward_positive_micros', string.format('%d', reward_micros))
    elseif reward_micros < 0 then
      redis.call('HINCRBY', KEYS[7], 'reward_negative_micros', string.format('%d', -reward_micros))
    end
    redis.call('LPUSH', KEYS[14], stream_id .. ' ' .. ARGV[17])
    redis.call('LTRIM', KEYS[14], 0, tonumber(ARGV[18]) - 1)
  end
end
-- (an episode bound before this counter existed must not drive it below zero)
if tonumber(redis.call('HGET', KEYS[7], 'open_episodes') or '0') > 0 then
  redis.call('HINCRBY', KEYS[7], 'open_episodes', -1)
end
if ARGV[14] ~= '' then
  redis.call('HINCRBY', KEYS[11], 'done', 1)
  if turns > 0 then
    redis.call('HSET', KEYS[10], 'group_id', ARGV[14], 'group_size', tonumber(ARGV[15]))
    redis.call('EXPIRE', KEYS[10], tonumber(ARGV[9]))
  end
end
local ended_at = ARGV[7]
if held then
  ended_at = redis.call('HGET', KEYS[2], 'ended_at') or ARGV[7]
end
redis.call('HSET', KEYS[2], 'state', status, 'stream_id', stream_id, 'turns', turns,
  'ended_at', ended_at, 'end_reason', ARGV[8])
if held then
  if redis.call('HGET', KEYS[1], 'held') == ARGV[1] then
    redis.call('HDEL', KEYS[1], 'held')
  end
  if redis.call('HGET', KEYS[1], 'last_episode') == ARGV[1] then
    redis.call('HSET', KEYS[1], 'last_status', status, 'last_stream_id', stream_id,
      'last_trajectory_id', trajectory_id)
  end
else
  unbind(status, stream_id, trajectory_id, turns, ended_at)
end
redis.call('ZREM', KEYS[8], ARGV[10])
redis.call('HDEL', KEYS[13], ARGV[10])
redis.call('ZREM', KEYS[9], ARGV[10])
redis.call('UNLINK', KEYS[3], KEYS[4], KEYS[5])
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[9]))
return {status, stream_id, trajectory_id, turns}
