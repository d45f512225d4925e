-- A tenant's token bucket: `rate` tokens per second, at most `burst`; each request
-- takes one. Times come from Redis' clock, so every API replica shares one bucket.
-- ARGV[1]: {tenant, rate, burst}
-- Returns {allowed (1|0), tokens left (floor), ms until a token is free, ms until full}.
local o = cjson.decode(ARGV[1])
local key = K.rate(o.tenant)
local now = now_ms()
local cur = redis.call('HMGET', key, 'tokens', 'at_ms')
local tokens = tonumber(cur[1]) or o.burst
local at = tonumber(cur[2]) or now
tokens = math.min(o.burst, tokens + math.max(now - at, 0) * o.rate / 1000)
local allowed = 0
if tokens >= 1 then
  tokens = tokens - 1
  allowed = 1
end
redis.call('HSET', key, 'tokens', tostring(tokens), 'at_ms', now)
-- A full bucket holds no information: let the key go once it would be full again.
redis.call('PEXPIRE', key, math.ceil((o.burst - tokens) / o.rate * 1000) + 1000)
local wait_ms = 0
if allowed == 0 then wait_ms = math.ceil((1 - tokens) / o.rate * 1000) end
return {allowed, math.floor(tokens), wait_ms, math.ceil((o.burst - tokens) / o.rate * 1000)}
