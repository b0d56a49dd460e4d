-- KEYS[1] the stream; ARGV[1] max length when there is no group (0: never trim then).
-- Returns {entries trimmed, the MINID used ('' when none), mode: 'groups' | 'maxlen' | ''}.
if redis.call('EXISTS', KEYS[1]) == 0 then return {0, '', ''} end
local groups = redis.call('XINFO', 'GROUPS', KEYS[1])
if #groups == 0 then
  local max_len = tonumber(ARGV[1])
  if max_len > 0 and redis.call('XLEN', KEYS[1]) > max_len then
    return {redis.call('XTRIM', KEYS[1], 'MAXLEN', '=', max_len), '', 'maxlen'}
  end
  return {0, '', ''}
end
local best_ms, best_seq = nil, nil
for _, group in ipairs(groups) do
  local fields = {}
  for i = 1, #group, 2 do fields[group[i]] = group[i + 1] end
  local ms, seq
  if tonumber(fields['pending']) > 0 then
    local oldest = redis.call('XPENDING', KEYS[1], fields['name'])[2]
    ms, seq = string.match(oldest, '^(%d+)-(%d+)$')
    ms, seq = tonumber(ms), tonumber(seq)
  else
    ms, seq = string.match(fields['last-delivered-id'], '^(%d+)-(%d+)$')
    ms, seq = tonumber(ms), tonumber(seq) + 1
  end
  if best_ms == nil or ms < best_ms or (ms == best_ms and seq < best_seq) then
    best_ms, best_seq = ms, seq
  end
end
local min_id = string.format('%d-%d', best_ms, best_seq)
return {redis.call('XTRIM', KEYS[1], 'MINID', '=', min_id), min_id, 'groups'}
