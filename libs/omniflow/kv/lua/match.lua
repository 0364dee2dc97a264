-- Longest leading run of a block chain held by each live owner, in one call.
-- ARGV: prefix, hashes packed (16 bytes each). The namespace is checked by the caller and
-- is already mixed into every block hash.
-- Returns one row per live owner holding the first block:
-- {owner, matched, blocks in device, host, ssd tier, node, address, kind}
-- Candidates come from the first block's owners whose entry generation equals their live
-- lease value; each candidate's run is then read from its own per-generation hash with HMGET in growing
-- chunks (few commands whatever the chain length, early stop at the first miss).
local P, h = ARGV[1], ARGV[2]
local n = #h / 16
if n == 0 then return {} end
local first = redis.call('HGETALL', P .. 'b:' .. string.sub(h, 1, 16))
local fields = nil
local out = {}
for i = 1, #first, 2 do
  local o, v = first[i], tonumber(first[i + 1])
  local lease = redis.call('GET', P .. 'l:' .. o)
  if lease and tonumber(lease) == math.floor(v / 4) then
    if not fields then
      fields = {}
      for b = 1, n do fields[b] = string.sub(h, (b - 1) * 16 + 1, b * 16) end
    end
    local set = P .. 's:' .. o .. ':' .. lease
    -- Tiers are stored as '0'/'1'/'2'; comparing strings avoids a tonumber per block.
    local c0, c1, c2 = 0, 0, 0
    local pos, step, done = 1, 32, false
    while pos <= n and not done do
      local last = math.min(n, pos + step - 1)
      local vals = redis.call('HMGET', set, unpack(fields, pos, last))
      for j = 1, #vals do
        local t = vals[j]
        if t == '1' then
          c1 = c1 + 1
        elseif t == '2' then
          c2 = c2 + 1
        elseif t == '0' then
          c0 = c0 + 1
        else
          done = true
          break
        end
      end
      pos = last + 1
      step = math.min(step * 4, 2048)
    end
    local info = redis.call('HMGET', P .. 'o:' .. o, 'node', 'address', 'kind')
    out[#out + 1] = {o, c0 + c1 + c2, c0, c1, c2, info[1] or '', info[2] or '', info[3] or ''}
  end
end
return out
