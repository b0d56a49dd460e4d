-- Extends a marker's lifetime only if it still holds our token.
-- KEYS[1] marker; ARGV[1] token, ARGV[2] ttl in milliseconds. Returns 1 when extended, else 0.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
end
return 0
