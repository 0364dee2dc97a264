-- Longest leading run of a block chain held by each live owner, in one call.
-- ARGV: prefix, namespace (16 bytes), hashes packed (16 bytes each)
-- Returns one row per owner holding the first block:
-- {owner, matched, blocks in device, host, ssd tier, node, address, kind}
-- An entry counts only if its epoch equals the owner's live lease (GET of the lease key).
local P, ns, h = ARGV[1], ARGV[2], ARGV[3]
local n = #h / 16
if n == 0 then return {} end
local bpre = P .. 'b:' .. ns
local first = redis.call('HGETALL', bpre .. string.sub(h, 1, 16))
local cands, ep, matched, cnt = {}, {}, {}, {}
for i = 1, #first, 2 do
  local o, v = first[i], tonumber(first[i + 1])
  local e = math.floor(v / 4)
  local lease = redis.call('GET', P .. 'l:' .. o)
  if lease and tonumber(lease) == e then
    cands[#cands + 1] = o
    ep[o] = e
    matched[o] = 1
    local c = {0, 0, 0}
    c[v % 4 + 1] = 1
    cnt[o] = c
  end
end
local b = 2
while b <= n and #cands > 0 do
  local vals = redis.call('HMGET', bpre .. string.sub(h, (b - 1) * 16 + 1, b * 16), unpack(cands))
  local keep = {}
  for j = 1, #cands do
    local v = vals[j]
    if v then
      local o = cands[j]
      v = tonumber(v)
      if math.floor(v / 4) == ep[o] then
        keep[#keep + 1] = o
        matched[o] = b
        local c = cnt[o]
        c[v % 4 + 1] = c[v % 4 + 1] + 1
      end
    end
  end
  cands = keep
  b = b + 1
end
local out = {}
for o, m in pairs(matched) do
  local info = redis.call('HMGET', P .. 'o:' .. o, 'node', 'address', 'kind')
  local c = cnt[o]
  out[#out + 1] = {o, m, c[1], c[2], c[3], info[1] or '', info[2] or '', info[3] or ''}
end
return out
