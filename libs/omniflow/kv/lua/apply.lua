-- Apply a batch of block events of one owner (mode 'E', sequence checked and advanced)
-- or a chunk of a snapshot (mode 'S', sequence untouched).
-- ARGV: prefix, owner, epoch, mode, seq, packed events
-- An event is 34 bytes: kind (0 stored, 1 removed, 2 cleared, 3 cleared in one tier), tier,
-- namespace(16), hash(16).
-- Returns {status, last seq, applied}; status 0 ok, 1 unknown owner,
-- 2 stale epoch or lapsed lease, 3 sequence gap (last seq = what the index has).
local P, owner, epoch_s, mode = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local okey = P .. 'o:' .. owner
local cur = redis.call('HMGET', okey, 'epoch', 'seq', 'lease_ms', 'gen')
if not cur[1] then
  return {1, 0, 0}
end
local lkey = P .. 'l:' .. owner
if cur[1] ~= epoch_s or redis.call('GET', lkey) ~= cur[4] then
  return {2, tonumber(cur[2]), 0}
end
local seq = tonumber(ARGV[5])
if mode == 'E' and seq ~= tonumber(cur[2]) + 1 then
  return {3, tonumber(cur[2]), 0}
end
-- Entries are tagged with the generation (bumped by register and by snapshot).
local gen = tonumber(cur[4])
local set = P .. 's:' .. owner .. ':' .. cur[4]
local bpre = P .. 'b:'
local d = {0, 0, 0}
local data = ARGV[6]
local n = 0
-- The owner's per-generation hash is the truth for what it holds; the block's hash mirrors it.
-- The common case (a block new to this owner) costs two commands: HSETNX and HSET.
for off = 1, #data, 34 do
  local kind = string.byte(data, off)
  n = n + 1
  if kind == 2 then
    for _, m in ipairs(redis.call('HKEYS', set)) do
      redis.call('HDEL', bpre .. m, owner)
    end
    redis.call('DEL', set)
    redis.call('HSET', okey, 'n0', 0, 'n1', 0, 'n2', 0)
    d = {0, 0, 0}
  elseif kind == 3 then
    local t = string.byte(data, off + 1)
    local ts = tostring(t)
    local all = redis.call('HGETALL', set)
    for i = 1, #all, 2 do
      if all[i + 1] == ts then
        redis.call('HDEL', set, all[i])
        redis.call('HDEL', bpre .. all[i], owner)
        d[t + 1] = d[t + 1] - 1
      end
    end
  else
    -- Block hashes already mix in the namespace, so the hash alone names a block.
    local m = string.sub(data, off + 18, off + 33)
    if kind == 0 then
      local tier = string.byte(data, off + 1)
      if redis.call('HSETNX', set, m, tier) == 1 then
        redis.call('HSET', bpre .. m, owner, gen * 4 + tier)
        d[tier + 1] = d[tier + 1] + 1
      else
        local old = tonumber(redis.call('HGET', set, m))
        if old ~= tier then
          redis.call('HSET', set, m, tier)
          redis.call('HSET', bpre .. m, owner, gen * 4 + tier)
          d[old + 1] = d[old + 1] - 1
          d[tier + 1] = d[tier + 1] + 1
        end
      end
    else
      local old = redis.call('HGET', set, m)
      if old then
        redis.call('HDEL', set, m)
        redis.call('HDEL', bpre .. m, owner)
        old = tonumber(old)
        d[old + 1] = d[old + 1] - 1
      end
    end
  end
end
for t = 1, 3 do
  if d[t] ~= 0 then redis.call('HINCRBY', okey, 'n' .. (t - 1), d[t]) end
end
if mode == 'E' then
  redis.call('HSET', okey, 'seq', seq)
else
  seq = tonumber(cur[2])
end
redis.call('PEXPIRE', lkey, cur[3])
return {0, seq, n}
