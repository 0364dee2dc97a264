-- One bounded step of cleanup.
-- 1. Owners whose lease lapsed are dropped; their current block set becomes garbage.
-- 2. Up to `chunk` members of the oldest garbage set are removed from their blocks
--    (only entries of that set's generation: a newer one may hold the same block again).
-- ARGV: prefix, chunk, owner to drop now ('' for none: a graceful deregistration)
-- Returns {owners dropped, entries removed, garbage sets left}
local P, chunk, drop = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local dropped = 0
for _, o in ipairs(redis.call('SMEMBERS', P .. 'owners')) do
  if o == drop or redis.call('EXISTS', P .. 'l:' .. o) == 0 then
    local e = redis.call('HGET', P .. 'o:' .. o, 'gen')
    if e then redis.call('RPUSH', P .. 'gc', o .. '\n' .. e) end
    redis.call('DEL', P .. 'o:' .. o, P .. 'l:' .. o)
    redis.call('SREM', P .. 'owners', o)
    dropped = dropped + 1
  end
end
local removed = 0
local g = redis.call('LINDEX', P .. 'gc', 0)
if g then
  local nl = string.find(g, '\n', 1, true)
  local o, e = string.sub(g, 1, nl - 1), tonumber(string.sub(g, nl + 1))
  local set = P .. 's:' .. o .. ':' .. string.sub(g, nl + 1)
  local members = redis.call('HRANDFIELD', set, chunk)
  if #members > 0 then redis.call('HDEL', set, unpack(members)) end
  for _, m in ipairs(members) do
    local bk = P .. 'b:' .. m
    local v = redis.call('HGET', bk, o)
    if v and math.floor(tonumber(v) / 4) == e then
      redis.call('HDEL', bk, o)
      removed = removed + 1
    end
  end
  if redis.call('EXISTS', set) == 0 then redis.call('LPOP', P .. 'gc') end
end
return {dropped, removed, redis.call('LLEN', P .. 'gc')}
