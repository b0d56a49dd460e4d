-- Compare-and-set of a session's affinity: sets it only if it still holds what this router
-- read (ARGV[1], "" for none) and the chosen worker is still registered, and moves the
-- session from the previous worker's session set (KEYS[4]) to the chosen one's (KEYS[3]).
-- Returns 1 when set. A router that loses the race reads the winner's choice on its next round.
-- Milliseconds on Redis's clock, the one that also expires the affinities, so every router
-- agrees on which sessions are still live.
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local current = redis.call('GET', KEYS[1]) or ''
if current ~= ARGV[1] then return 0 end
if redis.call('HEXISTS', KEYS[2], ARGV[2]) == 0 then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
if current ~= '' and current ~= ARGV[2] then redis.call('ZREM', KEYS[4], ARGV[4]) end
redis.call('ZADD', KEYS[3], string.format('%d', now_ms), ARGV[4])
return 1
