-- Start a snapshot: a new epoch (old entries are ignored at once and swept later),
-- sequence 0, block counters reset.
-- ARGV: prefix, owner, epoch
-- Returns {status, new epoch}; status 0 ok, 1 unknown owner, 2 stale epoch or lapsed lease
local P, owner, epoch_s = ARGV[1], ARGV[2], ARGV[3]
local okey = P .. 'o:' .. owner
local cur = redis.call('HMGET', okey, 'epoch', 'lease_ms')
if not cur[1] then
  return {1, 0}
end
local lkey = P .. 'l:' .. owner
if cur[1] ~= epoch_s or redis.call('GET', lkey) ~= epoch_s then
  return {2, tonumber(cur[1])}
end
redis.call('RPUSH', P .. 'gc', owner .. '\n' .. epoch_s)
local epoch = redis.call('INCR', P .. 'e:' .. owner)
redis.call('HSET', okey, 'epoch', epoch, 'seq', 0, 'n0', 0, 'n1', 0, 'n2', 0)
redis.call('SET', lkey, epoch, 'PX', cur[2])
return {0, epoch}
