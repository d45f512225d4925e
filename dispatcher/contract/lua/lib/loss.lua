-- A task given back: requeued, or failed once its attempts are spent.

-- Put a task back in its class queue (and its lane), as if never started: at the head
-- (it was taken before the others) or, for a retry after an error, at the tail.
local function requeue(id, cls, classes, extra, at_head)
  local jk = K.job(id)
  redis.call('HSET', jk, 'status', 'queued', 'worker_name', '', 'started_ms', '',
    'started_at', '', 'device', '', 'progress', '', unpack(extra))
  local f = redis.call('HMGET', jk, 'lane', 'gpu_mb', 'items', 'route', 'type')
  enqueue(cls, id, f[1], at_head, f[3])
  wake(cls, classes, f[2], f[4] == '1' and f[5])
  notify(id)
end

-- The worker holding task `id` died, or (`fault` given: {code, message}) it hit a GPU
-- fault that may be the task's doing: requeue the task at the head of its queue with
-- one more lost attempt, or fail it once its attempts are spent, so a task that breaks
-- every GPU it touches still ends. Returns 'requeued', 'failed', 'canceled' or 'gone',
-- the task's type and its items (for the caller's metrics, which count items).
local function lose(id, cls, w, now, o, fault)
  local jk = K.job(id)
  local f = redis.call('HMGET', jk, 'status', 'lost', 'attempts', 'history', 'cancel', 'tenant',
    'quota', 'type', 'bytes', 'items', 'parent', 'part')
  local task_type = f[8] or '-'
  local items = tonumber(f[10]) or 1
  if not f[1] or FINAL[f[1]] then return 'gone', task_type, items end
  local quota = quota_of(f[6], f[7])
  local lost = (tonumber(f[2]) or 0) + 1
  local history = f[4] and cjson.decode(f[4]) or {}
  local entry = {worker = w, attempt = tonumber(f[3]) or 0, outcome = 'worker_lost', at = iso(now)}
  if fault then entry.outcome = fault.code; entry.message = fault.message end
  history[#history + 1] = entry
  local hist = cjson.encode(history)
  if f[5] == '1' then
    local why = cjson.encode({code = 'canceled',
      message = 'Canceled; its worker stopped while canceling it.'})
    finalize(id, 'canceled', now, o.ttl_s, {'lost', lost, 'history', hist, 'error', why},
      quota, cls, f[9])
    if f[11] then fold(f[11], tonumber(f[12]), 'canceled', '', 0, why, 0, now, o.ttl_s) end
    return 'canceled', task_type, items
  end
  if lost >= o.max_attempts then
    local error = {code = 'worker_lost', attempts = history,
      message = 'The worker running this task died ' .. lost .. ' times; giving up.'}
    if fault then
      error.code = fault.code
      error.message = 'The task hit a GPU fault or lost its worker ' .. lost ..
        ' times; giving up. Last: ' .. fault.message
    end
    local why = cjson.encode(error)
    finalize(id, 'failed', now, o.ttl_s, {'lost', lost, 'history', hist, 'error', why},
      quota, cls, f[9])
    if f[11] then fold(f[11], tonumber(f[12]), 'failed', '', 0, why, 0, now, o.ttl_s) end
    return 'failed', task_type, items
  end
  requeue(id, cls, o.classes, {'lost', lost, 'history', hist}, true)
  return 'requeued', task_type, items
end
