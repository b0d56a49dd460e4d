-- Starts a turn in one round trip: resolves the key to its episode, refuses while submission
-- is paused, registers the turn's in-flight lease, pushes the episode's idle deadline to at
-- least the lease's (so the idle reaper never ends an episode while one of its turns runs,
-- however long that turn is), counts the turn among its episode's running turns and reads the
-- weight version it is stamped with. A header-mode key's episode is the one its session
-- pointer names.
-- KEYS[1] key hash, KEYS[2] paused flag, KEYS[3] in-flight zset (token → lease deadline),
-- KEYS[4] weight version, KEYS[5] the session pointer hash (header mode; unused otherwise),
-- KEYS[6] idle zset ({digest}/{episode} → idle deadline), KEYS[7] running-turns hash
-- ({digest}/{episode} → turns holding a lease)
-- ARGV: token, lease deadline, now, session id ('' when none), key digest
-- Returns {status, key_id, episode, epoch, weight_version, mode}: ok | unknown (no such key) |
-- not_active (a per-episode key between episodes) | needs_session (a header-mode key without
-- a session id) | new (header mode: the session has no active episode; the 4th value is how
-- many episodes it had) | paused.
local key = redis.call('HMGET', KEYS[1], 'key_id', 'state', 'episode', 'epoch', 'mode')
if not key[1] then
  return {'unknown', '', '', 0, 0, ''}
end
local mode = key[5] or 'key'
local episode, epoch = key[3] or '', tonumber(key[4] or '0')
if mode == 'header' then
  if ARGV[4] == '' then
    return {'needs_session', key[1], '', 0, 0, mode}
  end
  local session = redis.call('HMGET', KEYS[5], 'episode', 'epoch', 'count')
  if not session[1] or session[1] == '' then
    return {'new', key[1], '', tonumber(session[3] or '0'), 0, mode}
  end
  episode, epoch = session[1], tonumber(session[2] or '0')
elseif key[2] ~= 'active' then
  return {'not_active', key[1], '', 0, 0, mode}
end
if redis.call('EXISTS', KEYS[2]) == 1 then
  return {'paused', key[1], episode, epoch, 0, mode}
end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', ARGV[3])
redis.call('ZADD', KEYS[3], tonumber(ARGV[2]), ARGV[1])
local member = ARGV[5] .. '/' .. episode
redis.call('HINCRBY', KEYS[7], member, 1)
local idle_deadline = tonumber(redis.call('ZSCORE', KEYS[6], member) or '0')
if idle_deadline < tonumber(ARGV[2]) then
  redis.call('ZADD', KEYS[6], tonumber(ARGV[2]), member)
end
return {'ok', key[1], episode, epoch, tonumber(redis.call('GET', KEYS[4]) or '0'), mode}
