-- Take the next task this worker may run: move it from its class queue into the
-- worker's in-flight list and mark it started, in one atomic step, so a kill at any
-- instant leaves the task either queued or leased, never neither. Classes are tried
-- in priority order, except that a lower class whose oldest task has waited past its
-- promotion age goes first (batch cannot starve behind a stream of interactive work).
-- With nothing to take, the worker parks in the idle sets of its classes, where
-- submit.lua finds it to ring its doorbell.
-- ARGV[1]: {worker, classes (priority order), aging {class: ms}, was_idle, device,
--           redeliver (the caller lost the reply of its last claim)}
-- Returns {id, class, data, attempts, timeout, created_ms, started_ms, file|nil} or nil.
local o = cjson.decode(ARGV[1])
local w = o.worker

-- Move the head of class c into the in-flight list; drop stale ids (record expired or
-- already final). Returns id and its fields, or nil.
local function take(c)
  local ik = K.inflight(w, c)
  while true do
    local id = redis.call('LMOVE', K.queue(c), ik, 'LEFT', 'RIGHT')
    if not id then return nil end
    local f = redis.call('HMGET', K.job(id), 'status', 'data', 'attempts', 'timeout_s',
      'created_ms', 'has_file')
    if f[1] == 'queued' and f[2] then return id, f end
    redis.call('LREM', ik, 0, id)
  end
end

-- The first class below position i whose oldest task waited longer than its aging.
local function aged_below(i, now)
  for j = i + 1, #o.classes do
    local c = o.classes[j]
    local after = o.aging[c]
    if after then
      local head = redis.call('LINDEX', K.queue(c), 0)
      local created = head and tonumber(redis.call('HGET', K.job(head), 'created_ms'))
      if created and now - created >= after then return c end
    end
  end
  return nil
end

local function start(id, c, f, now)
  local attempts = (tonumber(f[3]) or 0) + 1
  local ts = iso(now)
  redis.call('HSET', K.job(id), 'status', 'started', 'started_at', ts, 'last_heartbeat', ts,
    'started_ms', now, 'worker_name', w, 'attempts', attempts, 'device', o.device)
  notify(id)
  local file = false
  if f[6] == '1' then file = redis.call('GET', K.file(id)) end
  return {id, c, f[2], attempts, f[4] or '', f[5] or '', now, file}
end

if o.was_idle then
  for _, c in ipairs(o.classes) do redis.call('SREM', K.idle(c), w) end
end

-- The reply to an earlier claim was lost (a timeout or a reset connection): the task it
-- took is in our in-flight list, started by us. Hand it over again, not another one,
-- or it would stay 'started' until this worker exits.
if o.redeliver then
  for _, c in ipairs(o.classes) do
    local id = redis.call('LINDEX', K.inflight(w, c), 0)
    if id then
      local f = redis.call('HMGET', K.job(id), 'status', 'data', 'attempts', 'timeout_s',
        'created_ms', 'has_file', 'worker_name', 'started_ms')
      if f[1] == 'started' and f[7] == w then
        local file = false
        if f[6] == '1' then file = redis.call('GET', K.file(id)) end
        return {id, c, f[2], tonumber(f[3]), f[4] or '', f[5] or '', tonumber(f[8]), file}
      end
    end
  end
end

for i, c in ipairs(o.classes) do
  local id, f = take(c)
  if id then
    local now = now_ms()
    local older = aged_below(i, now)
    if older then
      local aged_id, aged_f = take(older)
      if aged_id then
        redis.call('LMOVE', K.inflight(w, c), K.queue(c), 'RIGHT', 'LEFT') -- back to its head
        return start(aged_id, older, aged_f, now)
      end
    end
    return start(id, c, f, now)
  end
end

for _, c in ipairs(o.classes) do redis.call('SADD', K.idle(c), w) end
return nil
