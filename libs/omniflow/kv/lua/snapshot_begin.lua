-- Start a snapshot: a new generation (old entries are ignored at once and swept later),
-- the sequence set to the one the snapshot is consistent with, block counters reset.
-- The epoch does not change. ARGV: prefix, owner, epoch, seq
-- Returns {status, seq}; status 0 ok, 1 unknown owner, 2 stale epoch or lapsed lease
local P, owner, epoch_s = ARGV[1], ARGV[2], ARGV[3]
local okey = P .. 'o:' .. owner
local cur = redis.call('HMGET', okey, 'epoch', 'lease_ms', 'gen')
if not cur[1] then
  return {1, 0}
end
local lkey = P .. 'l:' .. owner
if cur[1] ~= epoch_s or redis.call('GET', lkey) ~= cur[3] then
  return {2, 0}
end
redis.call('RPUSH', P .. 'gc', owner .. '\n' .. cur[3])
local gen = redis.call('INCR', P .. 'g:' .. owner)
redis.call('HSET', okey, 'gen', gen, 'seq', ARGV[4], 'n0', 0, 'n1', 0, 'n2', 0)
redis.call('SET', lkey, gen, 'PX', cur[2])
return {0, tonumber(ARGV[4])}
