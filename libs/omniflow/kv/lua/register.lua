-- Register (or re-register) an owner: a new epoch and generation, a fresh lease, sequence 0.
-- ARGV: prefix, owner, node, address, kind, lease_ms, candidate run id, epoch (the caller's
-- one counter for every shard of the index; absent: this shard's own counter)
-- Returns {epoch, run id, 1 if the run marker had to be created (empty or new Redis) else 0}
local P, owner = ARGV[1], ARGV[2]
local run = redis.call('GET', P .. 'run')
local created = 0
if not run then
  run = ARGV[7]
  redis.call('SET', P .. 'run', run)
  created = 1
end
local okey = P .. 'o:' .. owner
local old = redis.call('HGET', okey, 'gen')
if old then
  -- The previous generation's block set becomes garbage; the sweep removes its entries.
  redis.call('RPUSH', P .. 'gc', owner .. '\n' .. old)
end
local epoch
if ARGV[8] then
  epoch = tonumber(ARGV[8])
  redis.call('SET', P .. 'e:' .. owner, epoch)
else
  epoch = redis.call('INCR', P .. 'e:' .. owner)
end
local gen = redis.call('INCR', P .. 'g:' .. owner)
redis.call('DEL', okey)
redis.call('HSET', okey, 'epoch', epoch, 'gen', gen, 'seq', 0, 'node', ARGV[3],
  'address', ARGV[4], 'kind', ARGV[5], 'lease_ms', ARGV[6], 'n0', 0, 'n1', 0, 'n2', 0)
redis.call('SET', P .. 'l:' .. owner, gen, 'PX', ARGV[6])
redis.call('SADD', P .. 'owners', owner)
return {epoch, run, created}
