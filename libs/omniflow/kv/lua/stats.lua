-- Counts for monitoring. ARGV: prefix
-- Returns {live owners, registered owners, device, host, ssd, namespaces, garbage sets}
local P = ARGV[1]
local live, t0, t1, t2 = 0, 0, 0, 0
for _, o in ipairs(redis.call('SMEMBERS', P .. 'owners')) do
  if redis.call('EXISTS', P .. 'l:' .. o) == 1 then
    live = live + 1
    local c = redis.call('HMGET', P .. 'o:' .. o, 'n0', 'n1', 'n2')
    t0 = t0 + (tonumber(c[1]) or 0)
    t1 = t1 + (tonumber(c[2]) or 0)
    t2 = t2 + (tonumber(c[3]) or 0)
  end
end
return {live, redis.call('SCARD', P .. 'owners'), t0, t1, t2, redis.call('HLEN', P .. 'ns'), redis.call('LLEN', P .. 'gc')}
