-- Take the next task this worker may run: move it from its class queue into the
-- worker's in-flight list and mark it started, in one atomic step, so a kill at any
-- instant leaves the task either queued or leased, never neither. Classes are tried
-- in the order given (priority order). With nothing to take, the worker parks in the
-- idle sets of its classes, where submit.lua finds it to ring its doorbell.
-- ARGV[1]: {worker, classes, was_idle, device}
-- Returns {id, class, data, attempts, timeout, created_ms, started_ms, file|nil} or nil.
local o = cjson.decode(ARGV[1])
local w = o.worker

if o.was_idle then
  for _, c in ipairs(o.classes) do redis.call('SREM', K.idle(c), w) end
end

for _, c in ipairs(o.classes) do
  local ik = K.inflight(w, c)
  while true do
    local id = redis.call('LMOVE', K.queue(c), ik, 'LEFT', 'RIGHT')
    if not id then break end
    local jk = K.job(id)
    local f = redis.call('HMGET', jk, 'status', 'data', 'attempts', 'timeout', 'created_ms',
      'has_file')
    if f[1] == 'queued' and f[2] then
      local now = now_ms()
      local attempts = (tonumber(f[3]) or 0) + 1
      local ts = iso(now)
      redis.call('HSET', jk, 'status', 'started', 'started_at', ts, 'last_heartbeat', ts,
        'started_ms', now, 'worker_name', w, 'attempts', attempts, 'device', o.device)
      local file = false
      if f[6] == '1' then file = redis.call('GET', K.file(id)) end
      return {id, c, f[2], attempts, f[4] or '', f[5] or '', now, file}
    end
    -- A stale id (its record expired, or it already ended): drop it, look further.
    redis.call('LREM', ik, 0, id)
  end
end

for _, c in ipairs(o.classes) do redis.call('SADD', K.idle(c), w) end
return nil
