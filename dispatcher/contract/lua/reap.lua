-- Hand back the tasks of workers whose lease expired. Any process may call this every
-- heartbeat; the lock makes one pass per period run, pool-wide.
-- ARGV[1]: {lock_ms, ttl_ms, ttl_s, max_attempts, classes, limit}
-- Returns {"id|class|type|outcome|items", ...} for the tasks it touched.
local o = cjson.decode(ARGV[1])
if not redis.call('SET', K.REAPER_LOCK, '1', 'NX', 'PX', o.lock_ms) then return {} end
local now = now_ms()
local last = tonumber(redis.call('GET', K.REAPER_LAST) or '0')
redis.call('SET', K.REAPER_LAST, now)
if last > 0 and now - last > o.ttl_ms then
  -- Nobody could renew a lease for a while (Redis was down, or every process was):
  -- give every worker one more lease period instead of declaring them all dead.
  for _, w in ipairs(redis.call('ZRANGEBYSCORE', K.WORKERS, '-inf', now)) do
    redis.call('ZADD', K.WORKERS, now + o.ttl_ms, w)
  end
  return {}
end
local dead = redis.call('ZRANGEBYSCORE', K.WORKERS, '-inf', now, 'LIMIT', 0, o.limit)
local out = {}
for _, w in ipairs(dead) do
  for _, line in ipairs(reap_worker(w, now, o)) do out[#out + 1] = line end
end
return out
