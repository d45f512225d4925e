-- Take the next task this worker may run: move it from its class queue into the
-- worker's in-flight list and mark it started, in one atomic step, so a kill at any
-- instant leaves the task either queued or leased, never neither. Classes are tried
-- in priority order, except that a lower class whose oldest task has waited past its
-- promotion age goes first (batch cannot starve behind a stream of interactive work).
-- With nothing to take, the worker parks in the idle sets of its classes, where
-- submit.lua finds it to ring its doorbell.
-- Dynamic batching: when the task taken is of a type in `batch` ({type: max_size}),
-- the same step takes more tasks of that type from the head of the same queue, up to
-- max_size in all, stopping at the first task of another type (so other types keep
-- their order) and taking none while a higher class has a task queued. Each is
-- started and in flight exactly like a single claim; the reaper gives back them all.
-- `more` ({class, type, n}): only take up to n more such head tasks (a short batch
-- waiting for more); nothing is parked.
-- ARGV[1]: {worker, classes (priority order), aging {class: ms}, was_idle, device,
--           redeliver (the caller lost the reply of its last claim), batch, more?}
-- Returns {task, ...} (task: {id, class, data, attempts, timeout, created_ms,
-- started_ms, file|nil}; more than one only for a batch) or nil; with `more`,
-- {stop (1: stop waiting), task, ...}.
local o = cjson.decode(ARGV[1])
local w = o.worker
local FIELDS = {'status', 'data', 'attempts', 'timeout_s', 'created_ms', 'has_file', 'type'}

-- Move the head of class c into the in-flight list; drop stale ids (record expired or
-- already final). Returns id and its fields, or nil.
local function take(c)
  local ik = K.inflight(w, c)
  while true do
    local id = redis.call('LMOVE', K.queue(c), ik, 'LEFT', 'RIGHT')
    if not id then return nil end
    local f = redis.call('HMGET', K.job(id), unpack(FIELDS))
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
  return {id, c, f[2], attempts, f[4] or '', f[5] or '', now, file, f[7] or ''}
end

-- A task of a class served before position i is queued.
local function higher_queued(i)
  for j = 1, i - 1 do
    if redis.call('LLEN', K.queue(o.classes[j])) > 0 then return true end
  end
  return false
end

-- Start up to n more head tasks of class c and type t into out. Returns true when
-- waiting cannot bring more: the head is another type's task.
local function take_same(c, t, n, now, out)
  local qk = K.queue(c)
  local added = 0
  while added < n do
    local id = redis.call('LINDEX', qk, 0)
    if not id then return false end
    local f = redis.call('HMGET', K.job(id), unpack(FIELDS))
    if f[1] == 'queued' and f[2] then
      if f[7] ~= t then return true end
      redis.call('LMOVE', qk, K.inflight(w, c), 'LEFT', 'RIGHT')
      out[#out + 1] = start(id, c, f, now)
      added = added + 1
    else
      redis.call('LPOP', qk) -- stale id (record expired or final), as take() drops it
    end
  end
  return false
end

local function class_index(c)
  for i, name in ipairs(o.classes) do if name == c then return i end end
  return nil
end

if o.more then
  local m = o.more
  local i = class_index(m.class)
  if not i or higher_queued(i) then return {1} end
  local out = {0}
  if take_same(m.class, m.type, m.n, now_ms(), out) then out[1] = 1 end
  return out
end

-- The first task is started: add the rest of its batch when its type is batched.
local function with_batch(task, c, t, now)
  local out = {task}
  local size = t and o.batch and o.batch[t]
  if size and size > 1 and not higher_queued(class_index(c)) then
    take_same(c, t, size - 1, now, out)
  end
  return out
end

if o.was_idle then
  for _, c in ipairs(o.classes) do redis.call('SREM', K.idle(c), w) end
end

-- The reply to an earlier claim was lost (a timeout or a reset connection): the task it
-- took is in our in-flight list, started by us. Hand it over again, not another one,
-- or it would stay 'started' until this worker exits.
-- A batch is redelivered whole.
if o.redeliver then
  for _, c in ipairs(o.classes) do
    local out = {}
    for _, id in ipairs(redis.call('LRANGE', K.inflight(w, c), 0, -1)) do
      local f = redis.call('HMGET', K.job(id), 'status', 'data', 'attempts', 'timeout_s',
        'created_ms', 'has_file', 'worker_name', 'started_ms', 'type')
      if f[1] == 'started' and f[7] == w then
        local file = false
        if f[6] == '1' then file = redis.call('GET', K.file(id)) end
        out[#out + 1] = {id, c, f[2], tonumber(f[3]), f[4] or '', f[5] or '',
          tonumber(f[8]), file, f[9] or ''}
      end
    end
    if #out > 0 then return out end
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
        return {start(aged_id, older, aged_f, now)} -- higher class queued: no batch
      end
    end
    return with_batch(start(id, c, f, now), c, f[7], now)
  end
end

for _, c in ipairs(o.classes) do redis.call('SADD', K.idle(c), w) end
return nil
