-- Refresh an owner's lease.
-- ARGV: prefix, owner, epoch
-- Returns {status, run id, last seq}; status 0 ok, 1 unknown owner, 2 stale epoch or lapsed lease
local P, owner, epoch = ARGV[1], ARGV[2], ARGV[3]
local run = redis.call('GET', P .. 'run') or ''
local okey = P .. 'o:' .. owner
local cur = redis.call('HMGET', okey, 'epoch', 'seq', 'lease_ms', 'gen')
if not cur[1] then
  return {1, run, 0}
end
local lkey = P .. 'l:' .. owner
if cur[1] ~= epoch or redis.call('GET', lkey) ~= cur[4] then
  return {2, run, tonumber(cur[2])}
end
redis.call('PEXPIRE', lkey, cur[3])
return {0, run, tonumber(cur[2])}
