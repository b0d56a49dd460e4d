-- Per consumer group, in one round trip: pending entries, last delivered id, consumers, the
-- oldest pending id and the first id not yet delivered (only ids leave the script).
if redis.call('EXISTS', KEYS[1]) == 0 then return {0, {}} end
local out = {}
for _, group in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
  local f = {}
  for i = 1, #group, 2 do f[group[i]] = group[i + 1] end
  local oldest = ''
  if tonumber(f['pending']) > 0 then
    oldest = redis.call('XPENDING', KEYS[1], f['name'])[2]
  end
  local after = redis.call('XRANGE', KEYS[1], '(' .. f['last-delivered-id'], '+', 'COUNT', 1)[1]
  local nxt = ''
  if after then nxt = after[1] end
  table.insert(out, {f['name'], f['pending'], f['last-delivered-id'], f['consumers'], oldest, nxt})
end
return {redis.call('XLEN', KEYS[1]), out}
