-- A worker starts: refuse a name a live worker holds, give back what an earlier
-- process of the same name left in flight, then publish the worker, its task types
-- (the catalog the API validates submissions against), RQ's queue index and RQ's
-- worker registry (so `rq info` lists it). A worker registers twice: before it has a
-- device (so it is visible while it waits for a free GPU) and once its task modules
-- are loaded; the second call carries the same `instance` token, so its own live
-- lease does not count as another worker's.
-- ARGV[1]: {worker, ttl_ms, ttl_s, max_attempts, classes (all configured),
--           info {field: string}, catalog {type: json}, rq (see rq_publish)}
-- Returns {'ok', {"id|class|type|outcome|items", ...}} | {'name_in_use'}.
local o = cjson.decode(ARGV[1])
local now = now_ms()
local deadline = redis.call('ZSCORE', K.WORKERS, o.worker)
-- A worker that reported itself unhealthy holds nothing and is exiting: its
-- restarted process need not wait for its lease to run out.
local held = redis.call('HMGET', K.worker(o.worker), 'instance', 'state')
if deadline and tonumber(deadline) > now and held[1] ~= o.info.instance
  and held[2] ~= 'unhealthy' then
  return {'name_in_use'}
end
local recovered = reap_worker(o.worker, now, o)
for _, c in ipairs(o.classes) do redis.call('SADD', K.RQ_QUEUES, K.queue(c)) end
for task_type, spec in pairs(o.catalog) do redis.call('HSET', K.CATALOG, task_type, spec) end
local info = {'last_heartbeat_ms', now}
for k, v in pairs(o.info) do info[#info + 1] = k; info[#info + 1] = v end
redis.call('HSET', K.worker(o.worker), unpack(info))
redis.call('ZADD', K.WORKERS, now + o.ttl_ms, o.worker)
rq_publish(o.worker, now, o.ttl_ms, o.rq)
return {'ok', recovered}
