-- Take the next task this worker may run: move it from its class queue into the
-- worker's in-flight list and mark it started, in one atomic step, so a kill at any
-- instant leaves the task either queued or leased, never neither. Classes are tried
-- in priority order, except that a lower class whose oldest task has waited past its
-- promotion age goes first (batch cannot starve behind a stream of interactive work).
-- Inside a class, tasks are served in arrival order, or under fair share (the class
-- has active tenant lanes, see the prelude) from the lane with the smallest start tag.
-- Placement: with `mem` (MB of GPU memory free for a task on this worker's card), a
-- task whose gpu_mb is more is left for a worker that can hold it, and the first of
-- the next SCAN tasks that fits is taken instead (per lane under fair share).
-- With nothing to take, the worker parks in the idle sets of its classes, scored by its
-- `rank` (from its speed) and `mem` (see park_score in the prelude), where submit.lua
-- finds it to ring its doorbell.
-- Dynamic batching: when the task taken is of a type in `batch` ({type: max_size}),
-- the same step takes the next tasks of the class (in the same order a claim would)
-- while they are of that type, up to max_size items in all (a chunk brings its
-- `items`; one larger than the room left waits for the next batch), and none while a
-- higher class has a task queued. Each is started and in flight exactly like a single claim; the
-- reaper gives back them all.
-- `more` ({class, type, n}): only take up to n more items of such tasks (a short batch
-- waiting for more); nothing is parked.
-- Routing: a record with `route` '1' (a backend model's type) is taken only by a worker
-- that lists its type in `types` (a backend worker), and a worker with `types` takes
-- nothing else; it parks in those types' idle sets (gpulane:parked:<class>:<type>),
-- where a routed submit rings it. Other workers pass over routed records as over one
-- too big for their card (the same SCAN).
-- ARGV[1]: {worker, classes (priority order), aging {class: ms}, was_idle, device,
--           redeliver (the caller lost the reply of its last claim), running? ({id: attempt}
--           the caller runs already: a redelivery leaves them out), batch, rank?, mem?,
--           more?, types?, fair_time (fair share charges device time, not items)}
-- Returns {task, ...} (task: {id, class, data, attempts, timeout, created_ms,
-- started_ms, file|nil, type, items, tenant, parent, part, merge (a part's: its parent, its
-- index, and the result key whose list is its part, '' for the whole result),
-- encoding_format ('' for float)}; more than one only for a batch) or nil; with `more`,
-- {stop (1: stop waiting), task, ...}.
local o = cjson.decode(ARGV[1])
local w = o.worker
local FIELDS = {'status', 'data', 'attempts', 'timeout_s', 'created_ms', 'has_file', 'type',
  'gpu_mb', 'lane', 'items', 'route', 'tenant', 'parent', 'part', 'merge', 'flatten',
  'encoding_format'}
-- A redelivery reads the run's owner and start with them, in the same HMGET.
local RUN_FIELDS = {unpack(FIELDS)}
RUN_FIELDS[#RUN_FIELDS + 1] = 'worker_name'
RUN_FIELDS[#RUN_FIELDS + 1] = 'started_ms'

-- Task `id`'s record fields `names` (FIELDS, RUN_FIELDS), by name.
local function read(id, names)
  local values = redis.call('HMGET', K.job(id), unpack(names))
  local f = {}
  for i, name in ipairs(names) do f[name] = values[i] end
  return f
end
local SCAN = 32 -- tasks looked at past one that does not fit this worker's GPU
local MAX_LANES = 64 -- lanes looked at when none of the first has a task that fits
local budget = 64 -- task records one claim reads past unfitting heads, in all

local serves = false -- a backend worker's types, as a set
if o.types then
  serves = {}
  for _, t in ipairs(o.types) do serves[t] = true end
end

-- Whether this worker may take a task of this GPU memory need, type and route flag.
local function may_take(gpu_mb, task_type, route)
  if o.mem and (tonumber(gpu_mb) or 0) > o.mem then return false end
  if serves then return serves[task_type] == true end
  return route ~= '1'
end

local function fits(f)
  return may_take(f.gpu_mb, f.type, f.route)
end

local function live(f)
  return f.status == 'queued' and f.data
end

-- The first task of list `key` this worker may run: the head or, when the head does
-- not fit, the first of the next SCAN that does (within the claim's budget). Stale ids
-- at the head (record expired or already final) are dropped. Returns id, fields,
-- index (0: the head) or nil.
local function first_fit(key)
  while true do
    local id = redis.call('LINDEX', key, 0)
    if not id then return nil end
    local f = read(id, FIELDS)
    if live(f) then
      if fits(f) then return id, f, 0 end
      break
    end
    redis.call('LPOP', key)
  end
  if budget <= 0 then return nil end
  for i, id in ipairs(redis.call('LRANGE', key, 1, math.min(SCAN, budget))) do
    budget = budget - 1
    local f = read(id, FIELDS)
    if live(f) and fits(f) then return id, f, i end
  end
  return nil
end

-- Under fair share: the first task that fits from the lanes in tag order.
local function peek_lanes(c, active)
  for i = 1, #active, 2 do
    local t, tag = active[i], tonumber(active[i + 1])
    local key = K.lane(c, t)
    local id, f, index = first_fit(key)
    if id then return {cls = c, id = id, f = f, index = index, lane = t, tag = tag} end
    if redis.call('LLEN', key) == 0 then lane_idle(c, t, tag) end -- held stale ids only
    budget = budget - 1 -- a lane's head read
    if budget <= 0 then return nil end
  end
  return nil
end

-- The head of class c moved into the in-flight list at once (the common case costs what
-- a plain dequeue does), as a pick (see peek) with `moved` set (its index in its lane
-- and its tag unknown), or nil when the class is empty. A caller that does not take it
-- calls unpeek.
local function peek_head(c)
  local qk, ik = K.queue(c), K.inflight(w, c)
  while true do
    local id = redis.call('LMOVE', qk, ik, 'LEFT', 'RIGHT')
    if not id then return nil end
    local f = read(id, FIELDS)
    if live(f) then
      return {cls = c, id = id, f = f, index = false, lane = f.lane ~= '' and f.lane or false,
        tag = false, moved = true}
    end
    redis.call('LREM', ik, -1, id) -- stale: record expired or already final
  end
end

-- Put a peeked task that is not taken after all back at the head of its class.
local function unpeek(p)
  if p.moved then redis.call('LMOVE', K.inflight(w, p.cls), K.queue(p.cls), 'RIGHT', 'LEFT') end
end

-- The task a claim on class c would take, a pick: {cls, id, f (its FIELDS by name),
-- index (in its lane; 0: the head; false: unknown), lane (its tenant, or false), tag
-- (its lane's start tag, or false: read it), moved (already in the in-flight list),
-- head ({id, created_ms} of the class list's head, when known)}.
-- The head if it has no lane and fits; else, under fair share (a laned head), the
-- lanes' first fit; else the first fit past the head. While the others are looked at,
-- the head stays in the in-flight list (so the class list starts past it); it is put
-- back unless it is the pick, and `head` tells take() what the list's head is.
local function peek(c)
  local head = peek_head(c)
  if not head then return nil end
  if not head.lane and fits(head.f) then return head end
  local p
  local active = redis.call('ZRANGE', K.lanes(c), 0, MAX_LANES - 1, 'WITHSCORES')
  if #active > 0 then
    p = peek_lanes(c, active)
  elseif fits(head.f) then -- a lane-tagged head with no lanes left (lost keys): serve it
    head.lane = false
    return head
  else
    local id, f, index = first_fit(K.queue(c))
    if id then p = {cls = c, id = id, f = f, index = index, lane = false, tag = false} end
  end
  if p and p.id == head.id then p.moved = true; return p end -- the head after all: moved
  unpeek(head)
  if p then p.head = {id = head.id, created_ms = head.f.created_ms} end
  return p
end

-- Take the peeked task: out of its lists into the in-flight list; charge its tenant.
-- Returns what its tenant was charged (nil: no lane).
local function take(p, now)
  local c, id, f, t = p.cls, p.id, p.f, p.lane
  local ik = K.inflight(w, c)
  if t then
    local key = K.lane(c, t)
    local removed = p.index == 0 and redis.call('LPOP', key) or redis.call('LREM', key, 1, id) > 0
    if removed then lane_extra(c, t, -extra(f.items)) end
  end
  if not p.moved then
    if t then
      unlist(c, id, f.created_ms, now, f.items, p.head)
    elseif redis.call('LREM', K.queue(c), 1, id) > 0 then
      class_extra(c, -extra(f.items))
    end
    redis.call('RPUSH', ik, id)
  else
    class_extra(c, -extra(f.items))
  end
  if t then
    local tag = p.tag or tonumber(redis.call('ZSCORE', K.lanes(c), t))
    return charge(c, t, tag, f.items, f.type, o.fair_time)
  end
  return nil
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

-- A task as the worker receives it (broker.Claimed), from its FIELDS.
local function handed(id, c, f, attempts, started_ms)
  local file = false
  -- A part reads its parent's upload: one copy of the document serves all its parts.
  if f.has_file == '1' then file = redis.call('GET', K.file(f.parent or id)) end
  return {id, c, f.data, attempts, f.timeout_s or '', f.created_ms or '', started_ms, file,
    f.type or '', tonumber(f.items) or 1, f.tenant or '', f.parent or '', f.part or '',
    f.flatten == '1' and f.merge or '', f.encoding_format or ''}
end

local function start(p, now)
  local charged = take(p, now)
  local id, c, f = p.id, p.cls, p.f
  local attempts = (tonumber(f.attempts) or 0) + 1
  local ts = iso(now)
  -- fc: what fair share charged this run, which its finish settles with the device
  -- time measured (0 without a lane: nothing to settle).
  redis.call('HSET', K.job(id), 'status', 'started', 'started_at', ts, 'last_heartbeat', ts,
    'started_ms', now, 'worker_name', w, 'attempts', attempts, 'device', o.device,
    'fc', num(charged or 0))
  notify(id, 'started')
  return handed(id, c, f, attempts, now)
end

-- A task this worker could take is queued in a class served before position i (its
-- head: one too big for this worker's card does not count).
local function higher_queued(i)
  for j = 1, i - 1 do
    local head = redis.call('LINDEX', K.queue(o.classes[j]), 0)
    local f = head and read(head, {'gpu_mb', 'type', 'route'})
    if f and may_take(f.gpu_mb, f.type, f.route) then return true end
  end
  return false
end

-- Start more tasks of class c and type t into out, in claim order, while they fit in
-- `room` items (a task is one, a chunk its `items`). Returns true when waiting cannot
-- bring more: the next task is another type's, or a chunk larger than the room left.
local function take_same(c, t, room, now, out)
  while room > 0 do
    local p = peek(c)
    if not p then return false end
    local n = tonumber(p.f.items) or 1
    if p.f.type ~= t or n > room then unpeek(p); return true end
    out[#out + 1] = start(p, now)
    room = room - n
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

-- The first task is started: add the rest of its batch when its type is batched. (Every
-- class served before c had nothing this worker could take, or the claim would have
-- come from there.)
local function with_batch(task, c, t, now)
  local out = {task}
  local size = t and o.batch and o.batch[t]
  if size and size > 1 then take_same(c, t, size - task[10], now, out) end
  return out
end

-- The idle sets this worker parks in, for class c.
local function parked_sets(c)
  if not serves then return {K.parked(c)} end
  local out = {}
  for _, t in ipairs(o.types) do out[#out + 1] = K.parked_type(c, t) end
  return out
end

if o.was_idle then
  for _, c in ipairs(o.classes) do
    for _, key in ipairs(parked_sets(c)) do redis.call('ZREM', key, w) end
  end
end

-- The reply to an earlier claim was lost (a timeout or a reset connection): the task it
-- took is in our in-flight list, started by us. Hand it over again, not another one,
-- or it would stay 'started' until this worker exits. Every class's, but the attempts
-- the caller says it runs: a backend worker's other slots hold tasks too, of any class
-- (one whose report lands meanwhile is no longer 'started' here). A batch is
-- redelivered whole.
if o.redeliver then
  local out, running = {}, o.running or {}
  for _, c in ipairs(o.classes) do
    for _, id in ipairs(redis.call('LRANGE', K.inflight(w, c), 0, -1)) do
      local f = read(id, RUN_FIELDS)
      if f.status == 'started' and f.worker_name == w
        and running[id] ~= tonumber(f.attempts) then
        out[#out + 1] = handed(id, c, f, tonumber(f.attempts), tonumber(f.started_ms))
      end
    end
  end
  if #out > 0 then return out end
end

for i, c in ipairs(o.classes) do
  local p = peek(c)
  if p then
    local now = now_ms()
    local older = aged_below(i, now)
    -- Promotion takes the aged task itself (the lower class's head), never a younger
    -- one fair order or placement would pick; one this worker cannot hold stays.
    local aged = older and peek_head(older)
    if aged and not fits(aged.f) then unpeek(aged); aged = nil end
    if aged then
      unpeek(p)
      return {start(aged, now)} -- higher class queued: no batch
    end
    return with_batch(start(p, now), c, p.f.type, now)
  end
end

local score = park_score(o.rank, o.mem)
for _, c in ipairs(o.classes) do
  for _, key in ipairs(parked_sets(c)) do redis.call('ZADD', key, score, w) end
end
return nil
