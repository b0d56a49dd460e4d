-- Weight versions move forward; repeating the current one is a no-op; a lower one only with
-- allow_rollback (ARGV[2] = '1': a trainer restarted from an older checkpoint), which also
-- counts a rollback epoch. `<epoch>:<version>` is published on the channel named like the
-- key, which every replica's WeightVersionView follows (services/dataproxy/control.py) to
-- stamp streamed tokens as they pass: within an epoch it only moves forward.
local current = tonumber(redis.call('GET', KEYS[1]) or '0') or 0
local wanted = tonumber(ARGV[1])
local epoch = tonumber(redis.call('GET', KEYS[2]) or '0') or 0
if wanted < current then
  if ARGV[2] ~= '1' then return {0, tostring(current)} end
  epoch = redis.call('INCR', KEYS[2])
end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('PUBLISH', KEYS[1], tostring(epoch) .. ':' .. ARGV[1])
return {1, ARGV[1], tostring(current)}
