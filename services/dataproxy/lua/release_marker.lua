-- Deletes a marker only if it still holds our token (it may have expired and been retaken).
-- KEYS[1] marker; ARGV[1] token. Returns 1 when deleted, else 0.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
