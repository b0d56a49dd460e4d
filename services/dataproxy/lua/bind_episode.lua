-- Binds new active episodes, if capacity allows: one key ("new" or "next"), a group of new
-- keys (all or none), or ("header") one more episode of a header-mode key, named by its
-- session. Checking and taking capacity happen here, atomically.
-- KEYS[1] stats hash, KEYS[2] capacity hash, KEYS[3] weight version, KEYS[4] idle zset,
-- KEYS[5] group hash (unused without a group) or, in header mode, the session pointer hash,
-- then per member: key hash, episode hash.
-- ARGV[1] mode, ARGV[2] now, ARGV[3] max_head_offpolicyness (-1: no staleness bound),
-- ARGV[4] batch_size, ARGV[5] idle timeout s, ARGV[6] group_id ('' = none), ARGV[7] group
-- size, ARGV[8] ttl_s of the group hash, then per member: key_id, task_id, episode,
-- trajectory_id, digest, session_id.
-- Returns {status, epoch of the first member}: ok | exists (new: the key hash is taken;
-- header: the episode name is taken) | unknown | busy | full (no capacity; the second value
-- is the capacity left).
-- A retry of a call that already succeeded finds its own episode bound and returns ok (in
-- header mode: any active episode of the session, bound by a concurrent first call).
local n = (#KEYS - 5) / 2
local now = tonumber(ARGV[2])
local header = ARGV[1] == 'header'
if header then
  local session = redis.call('HMGET', KEYS[5], 'episode', 'epoch')
  if session[1] and session[1] ~= '' then
    return {'ok', tonumber(session[2])}
  end
else
  local first = redis.call('HMGET', KEYS[6], 'state', 'episode', 'epoch')
  if first[1] == 'active' and first[2] == ARGV[11] then
    return {'ok', tonumber(first[3])}
  end
end
for i = 1, n do
  local state = redis.call('HGET', KEYS[4 + 2 * i], 'state')
  if header then
    if redis.call('HGET', KEYS[4 + 2 * i], 'mode') ~= 'header' then
      return {'unknown', 0}
    end
    if redis.call('EXISTS', KEYS[5 + 2 * i]) == 1 then
      return {'exists', 0}
    end
  elseif ARGV[1] == 'new' then
    if state then
      return {'exists', 0}
    end
  else
    if not state then
      return {'unknown', 0}
    end
    if state == 'active' then
      return {'busy', 0}
    end
  end
end
-- Capacity: unlimited unless a staleness bound is configured or a grant was ever made.
local ofp = tonumber(ARGV[3])
local grants = redis.call('HGET', KEYS[2], 'grants')
local from_grants = 0
if ofp >= 0 or grants then
  local headroom = 0
  if ofp >= 0 then
    local stats = redis.call('HMGET', KEYS[1], 'open_episodes', 'published')
    local used = tonumber(stats[1] or '0') + tonumber(stats[2] or '0')
    local version = tonumber(redis.call('GET', KEYS[3]) or '0')
    headroom = math.max(0, (ofp + version + 1) * tonumber(ARGV[4]) - used)
  end
  local granted = tonumber(grants or '0')
  if headroom + granted < n then
    return {'full', headroom + granted}
  end
  from_grants = math.max(0, n - headroom)
end
if from_grants > 0 then
  redis.call('HINCRBY', KEYS[2], 'grants', -from_grants)
end
redis.call('HINCRBY', KEYS[1], 'open_episodes', n)
local deadline = now + tonumber(ARGV[5])
local first_epoch = 0
for i = 1, n do
  local key_hash, ep_hash = KEYS[4 + 2 * i], KEYS[5 + 2 * i]
  local base = 8 + 6 * (i - 1)
  local epoch = redis.call('HINCRBY', key_hash, 'epoch', 1)
  if i == 1 then
    first_epoch = epoch
  end
  if header then
    redis.call('HSET', KEYS[5], 'episode', ARGV[base + 3], 'epoch', epoch)
    redis.call('HINCRBY', KEYS[5], 'count', 1)
    redis.call('PERSIST', KEYS[5])
  else
    redis.call('HSET', key_hash, 'key_id', ARGV[base + 1], 'task_id', ARGV[base + 2],
      'state', 'active', 'episode', ARGV[base + 3])
  end
  if ARGV[1] == 'new' then
    redis.call('HSET', key_hash, 'created_at', ARGV[2])
  end
  redis.call('HSET', ep_hash, 'session_id', ARGV[base + 6], 'task_id', ARGV[base + 2],
    'epoch', epoch, 'state', 'active', 'trajectory_id', ARGV[base + 4], 'started_at', ARGV[2],
    'last_active_at', ARGV[2], 'turns', 0, 'last_interaction', '', 'group_id', ARGV[6],
    'group_size', tonumber(ARGV[7]))
  redis.call('ZADD', KEYS[4], deadline, ARGV[base + 5] .. '/' .. ARGV[base + 3])
end
if ARGV[6] ~= '' then
  redis.call('HSET', KEYS[5], 'size', tonumber(ARGV[7]), 'done', 0, 'created_at', ARGV[2])
  redis.call('EXPIRE', KEYS[5], tonumber(ARGV[8]))
end
return {'ok', first_epoch}
