-- RQ's worker registry.

-- RQ's execution hash of a `<job id>:<execution id>` member of a worker's executions.
local function rq_execution_key(member)
  local job_id, id = string.match(member, '^(.*):([^:]*)$')
  return K.rq_execution(job_id or member, id or '')
end

-- RQ's worker registry: drop worker `w` (its hash, its index entries, its execution).
local function rq_forget(w, classes)
  local key = K.rq_worker(w)
  redis.call('SREM', K.RQ_WORKERS, key)
  for _, c in ipairs(classes) do redis.call('SREM', K.rq_workers_of(c), key) end
  local ek = K.rq_worker_executions(w)
  for _, m in ipairs(redis.call('SMEMBERS', ek)) do redis.call('DEL', rq_execution_key(m)) end
  redis.call('DEL', key, ek)
end

-- Publish worker `w` in RQ's worker registry, in RQ 3's format, so `rq info`,
-- rq-dashboard and rq.Worker.all list it: the hash, the rq:workers and per-queue
-- indexes (added again every beat, since RQ's cleanup drops names whose hash expired)
-- and the running task as RQ's execution. Everything expires `ttl_ms` after the last
-- beat, as gpulane's lease does. `rq` = {fields {k: string}, queues, execution|null}.
local function rq_publish(w, now, ttl_ms, rq)
  local key = K.rq_worker(w)
  local f = {'last_heartbeat', iso(now)}
  for k, v in pairs(rq.fields) do f[#f + 1] = k; f[#f + 1] = v end
  redis.call('HSET', key, unpack(f))
  redis.call('PEXPIRE', key, ttl_ms)
  redis.call('SADD', K.RQ_WORKERS, key)
  for _, q in ipairs(rq.queues) do redis.call('SADD', K.rq_workers_of(q), key) end
  local ek = K.rq_worker_executions(w)
  local x = rq.execution
  local current = x ~= cjson.null and x and (x.job_id .. ':' .. x.id) or false
  for _, m in ipairs(redis.call('SMEMBERS', ek)) do
    if m ~= current then
      redis.call('SREM', ek, m)
      redis.call('DEL', rq_execution_key(m))
    end
  end
  if current then
    local xk = K.rq_execution(x.job_id, x.id)
    redis.call('HSET', xk, 'id', x.id, 'job_id', x.job_id, 'created_at', x.created_at,
      'last_heartbeat', now / 1000, 'worker_name', w)
    redis.call('PEXPIRE', xk, ttl_ms)
    redis.call('SADD', ek, current)
    redis.call('PEXPIRE', ek, ttl_ms)
  end
end
