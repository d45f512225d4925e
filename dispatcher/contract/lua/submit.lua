-- Admit a task and enqueue it, or refuse it, in one atomic step (invariant 5): N
-- concurrent submits against max_queued = M accept exactly M.
-- ARGV[1]: options (JSON, see dispatcher/store.py), ARGV[2]: the RQ call data,
-- ARGV[3]: the uploaded file's bytes ('' when there is none).
-- Fair share: with `lane` (the tenant, when tenants are configured) the task also joins
-- its tenant's lane (see the prelude), and its position and estimate count the tasks
-- fair order puts ahead of it, not the whole class queue; `weight` is the tenant's.
-- Returns {'accepted', id, depth_before, est_ms, ahead} | {'duplicate', id, status, class, type}
--       | {'idempotency_key_reused', id}
--       | {'no_workers'|'queue_full'|'over_quota', '', depth, est_ms, limit}.
-- est_ms = -1: cannot estimate (no live worker serves the class). limit (queue_full):
-- 'depth' (max_queued), 'wait' (max_wait_s) or 'bytes' (max_queued_bytes).
-- The idempotency key holds '<id> <fingerprint>' (the sha256 of the canonical request):
-- the same key with another request is refused, never replayed.
local o = cjson.decode(ARGV[1])

if o.idem ~= '' then
  local existing = redis.call('GET', K.idem(o.tenant, o.idem))
  if existing then
    local id, fp = string.match(existing, '^(%S+) ?(%x*)$')
    local f = redis.call('HMGET', K.job(id or existing), 'status', 'origin', 'type')
    if f[1] then
      if fp and fp ~= '' and fp ~= o.fingerprint then return {'idempotency_key_reused', id} end
      return {'duplicate', id, f[1], f[2], f[3]}
    end
  end
end

local depth = redis.call('LLEN', K.queue(o.class))
local ahead = depth
if o.lane ~= '' then
  redis.call('HSET', K.fair(o.class), 'w:' .. o.lane, o.weight)
  ahead = fair_ahead(o.class, o.lane, redis.call('LLEN', K.lane(o.class, o.lane)))
end
-- The tasks ahead drain at the whole class's pace (big cards take small tasks too);
-- the task itself waits for one of the `workers` that can hold it.
local est_ms = -1
if o.workers > 0 then
  est_ms = math.ceil((ahead / o.serving + 1 / o.workers) * o.run_s * 1000)
end

-- `workers`: live workers of the class whose card could hold the task; `serving`: all
-- of them. Some serve it, none could hold it: refused whatever reject_without_workers.
if o.workers == 0 and (o.reject_without_workers or o.serving > 0) then
  return {'no_workers', '', depth, est_ms, ''}
end
if depth >= o.max_queued then return {'queue_full', '', depth, est_ms, 'depth'} end
if est_ms >= 0 and est_ms > o.max_wait_s * 1000 then
  return {'queue_full', '', depth, est_ms, 'wait'}
end
local size = #ARGV[3]
if size > 0 and size + tonumber(redis.call('GET', K.queued_bytes(o.class)) or '0') > o.max_bytes then
  return {'queue_full', '', depth, est_ms, 'bytes'}
end
if o.max_in_flight > 0 and redis.call('ZCARD', K.tenant_tasks(o.tenant)) >= o.max_in_flight then
  return {'over_quota', '', depth, est_ms, ''}
end

local now = now_ms()
local ts = iso(now)
redis.call('HSET', K.job(o.id), 'data', ARGV[2], 'origin', o.class, 'status', 'queued',
  'created_at', ts, 'enqueued_at', ts, 'created_ms', now, 'description', o.type,
  'timeout', math.ceil(o.timeout), 'timeout_s', o.timeout, 'result_ttl', o.ttl_s, 'failure_ttl', o.ttl_s, 'type', o.type,
  'tenant', o.tenant, 'attempts', 0, 'lost', 0, 'has_file', ARGV[3] ~= '' and '1' or '0',
  'quota', o.max_in_flight > 0 and '1' or '0', 'bytes', size, 'lane', o.lane,
  'gpu_mb', o.gpu_mb)
if size > 0 then redis.call('INCRBY', K.queued_bytes(o.class), size) end
enqueue(o.class, o.id, o.lane, false)
if ARGV[3] ~= '' then redis.call('SET', K.file(o.id), ARGV[3]) end
if o.max_in_flight > 0 then redis.call('ZADD', K.tenant_tasks(o.tenant), now, o.id) end
if o.idem ~= '' then
  redis.call('SET', K.idem(o.tenant, o.idem), o.id .. ' ' .. o.fingerprint, 'EX', o.idem_ttl_s)
end
wake(o.class, o.classes, o.gpu_mb)
return {'accepted', o.id, depth, est_ms, ahead}
