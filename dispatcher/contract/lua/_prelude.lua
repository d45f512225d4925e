-- Helpers shared by every gpulane script. The loader (dispatcher/scripts.py) prepends
-- the key builders K.* generated from dispatcher/keys.py and the FINAL set of RQ
-- statuses generated from dispatcher/contract/jobs.py, then this file, then the
-- script itself. All times come from Redis' clock so hosts with skewed clocks agree.

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- RQ's timestamp format (2026-12-02T17:08:53.123000Z), from epoch milliseconds.
local function iso(ms)
  local secs = math.floor(ms / 1000)
  local days = math.floor(secs / 86400)
  local rem = secs - days * 86400
  local z = days + 719468 -- days-to-civil, H. Hinnant
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524)
    - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local day = doy - math.floor((153 * mp + 2) / 5) + 1
  local month = mp < 10 and mp + 3 or mp - 9
  local year = yoe + era * 400 + (month <= 2 and 1 or 0)
  return string.format('%04d-%02d-%02dT%02d:%02d:%02d.%06dZ', year, month, day,
    math.floor(rem / 3600), math.floor(rem % 3600 / 60), rem % 60, (ms % 1000) * 1000)
end

-- Tell every API process that task `id` changed (status or progress): its waiters
-- re-read the record (long-polls, Prefer: wait, event streams).
local function notify(id)
  redis.call('PUBLISH', K.EVENTS, id)
end

-- A parked worker's score in the idle sets: its rank (round(1000 / its speed): faster
-- is lower) above, the GPU memory it has free for a task (MB, NO_LIMIT without a GPU)
-- below. The lowest score is the fastest worker, and among equally fast ones the one
-- with the least memory free (best fit: big cards stay free for what only they hold).
-- A number as Redis should read it: every digit of a whole number (Lua would send 14
-- significant digits, and tags and scores run past that).
local function num(x)
  return string.format('%.17g', x)
end

local MEM_SPAN = 4294967296 -- 2^32: memory fits below it; scores stay exact doubles
local NO_LIMIT = 2147483647 -- MB: "no limit" (a cpu worker)
local function park_score(rank, mem)
  return num((tonumber(rank) or 1000) * MEM_SPAN + math.min(tonumber(mem) or NO_LIMIT, NO_LIMIT))
end

-- Ring the doorbell of the first parked worker of this class (by score, above) whose
-- GPU has `need` MB free (0 or nil: any worker). It leaves every idle set, so a second
-- task does not wake the same worker while another one sits idle. None fits: nobody is
-- rung; a worker finishing its task, or a parked one's periodic look, takes it.
-- A routed record (`routed`: its type, served only by the workers that declare it:
-- backend workers, one type per backend model) rings from that type's idle set
-- instead, gpulane:parked:<class>:<type>.
local SPEED_BANDS = 16 -- distinct speeds looked through for a task that needs memory
local function wake(cls, classes, need, routed)
  local function parked(c) return routed and K.parked_type(c, routed) or K.parked(c) end
  local ik = parked(cls)
  local w
  need = tonumber(need) or 0
  if need > 0 then
    -- The first worker scored at least band + need is, in its band, the fastest with
    -- room; or it is in a slower band, which is then searched the same way.
    local from = need
    for _ = 1, SPEED_BANDS do
      local hit = redis.call('ZRANGEBYSCORE', ik, num(from), '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
      if not hit[1] then break end
      local band = math.floor(tonumber(hit[2]) / MEM_SPAN) * MEM_SPAN
      if tonumber(hit[2]) - band >= need then w = hit[1]; break end
      from = band + need
    end
    if w then redis.call('ZREM', ik, w) end
  else
    w = redis.call('ZPOPMIN', ik)[1] -- one command: the usual doorbell costs no more
  end
  if w then
    for _, c in ipairs(classes) do
      if c ~= cls then redis.call('ZREM', parked(c), w) end
    end
    redis.call('LPUSH', K.wake(w), '1')
  end
  return w
end

-- Fair share among tenants inside a class: start-time fair queuing (Goyal et al.,
-- 1996), weighted, with device time as the cost. A task submitted with a lane (its
-- tenant, when tenants are configured) is queued twice: in rq:queue:<class>, in
-- arrival order (what RQ, KEDA and the depth limits read), and in its tenant's lane. A
-- claim serves the lane with the smallest virtual start tag and moves its tenant's tag
-- on by the task's estimated device time over the tenant's weight (whole weighted
-- microseconds: tags add up exactly, so ties are real ties, broken by the tenant
-- name's bytes, as the ZSET orders them), and the class's virtual clock up to the tag
-- served. The task's finish replaces the estimate with the device time its worker
-- measured (settle_time): the tag ends up moved by what the task really cost, as a
-- CFS vruntime does. A tenant whose lane was empty starts again at max(clock, its
-- last tag): it banks nothing while idle, keeps a debt until the clock passes it, and
-- does not wait behind another tenant's backlog. With a single tenant this is FIFO.

-- The cost of an item in `tasks` mode (fair_share_by): every item costs the same, so
-- fair share counts items. In device_time mode, an item of a type no finish has
-- measured yet is charged UNMEASURED_US: low rather than high, since a charge too
-- high moves the clock (the start tag served) past what its finish then refunds,
-- and newcomers would start behind; one too low is only made up at the finish.
local TURN_US = 1000000
local UNMEASURED_US = 1000
local EST_ALPHA = 0.2 -- weight of a new sample in a type's per-item estimate

-- Weighted cost of `us` microseconds of device time for a tenant of weight w.
local function cost_of(us, w)
  return math.max(math.floor(us / (tonumber(w) or 1) + 0.5), 1) -- never free: tags move
end

-- The class's virtual clock, from its stored value v (the greatest start tag served):
-- v, or the smallest active tag when a finish refunded a lane below v (its claim was
-- charged more than the task cost). Active tags are never below v otherwise.
local function clock(cls, v)
  local first = redis.call('ZRANGE', K.lanes(cls), 0, 0, 'WITHSCORES')
  if first[2] then return math.min(v, tonumber(first[2])) end
  return v
end

-- The class's stored clock and tenant t's saved next tag.
local function fair_state(cls, t)
  local f = redis.call('HMGET', K.fair(cls), 'v', 't:' .. t)
  return tonumber(f[1]) or 0, tonumber(f[2]) or 0
end

-- Items queued (max_queued and the wait estimate count items: a task is one, a chunk
-- its `items`) are a list's length plus its records' extra items, `items - 1` each:
-- gpulane:extra:<class> for the class list, field x:<tenant> of gpulane:fair:<class>
-- for a lane. Only chunks move the counts, so tasks cost no command and cannot make
-- them drift. A record joining a list adds its extra, one leaving (really removed)
-- takes it away.
local function extra(items)
  return (tonumber(items) or 1) - 1
end

local function class_extra(cls, n)
  if n ~= 0 then redis.call('INCRBY', K.queued_extra(cls), n) end
end

local function lane_extra(cls, lane, n)
  if n ~= 0 and lane and lane ~= '' then redis.call('HINCRBY', K.fair(cls), 'x:' .. lane, n) end
end

-- Items queued in a list of `len` records whose extra count is `x` (a lost key or a
-- record gone stale cannot make it less than the records themselves).
local function items_in(len, x)
  return len + math.max(tonumber(x) or 0, 0)
end

-- Queue task `id` (`items` of them: a chunk; nil: 1) of class `cls` at the tail (or
-- the head), in its tenant's lane too when it has one (`lane`: the tenant, or ''/false).
local function enqueue(cls, id, lane, at_head, items)
  local push = at_head and 'LPUSH' or 'RPUSH'
  redis.call(push, K.queue(cls), id)
  class_extra(cls, extra(items))
  if lane and lane ~= '' then
    lane_extra(cls, lane, extra(items))
    if redis.call(push, K.lane(cls, lane), id) == 1 then
      local v, tag = fair_state(cls, lane)
      redis.call('ZADD', K.lanes(cls), num(math.max(clock(cls, v), tag)), lane)
    end
  end
end

-- Tenant t's lane emptied: it leaves the active set, keeping its next tag for when it
-- comes back (then max(clock, tag)).
local function lane_idle(cls, t, next_tag)
  redis.call('ZREM', K.lanes(cls), t)
  redis.call('HSET', K.fair(cls), 't:' .. t, num(next_tag))
  redis.call('HDEL', K.fair(cls), 'x:' .. t) -- an empty lane holds no items
end

-- Charge tenant t (start tag `tag`) for the task of `task_type` just taken from its
-- lane: its type's estimated device time per item (`by_time`; UNMEASURED_US before a
-- measurement; TURN_US in tasks mode) times its items, over t's weight. Returns the cost charged, which
-- the task's record keeps (`fc`) for settle_time.
local function charge(cls, t, tag, items, task_type, by_time)
  local fk = K.fair(cls)
  local f = redis.call('HMGET', fk, 'v', 't:' .. t, 'w:' .. t, 'd:' .. task_type)
  local v, saved = tonumber(f[1]) or 0, tonumber(f[2]) or 0
  local per = cost_of(by_time and (tonumber(f[4]) or UNMEASURED_US) or TURN_US, f[3])
  local cost = per * (tonumber(items) or 1)
  -- No tag (the lanes' index lost the tenant): where a fresh lane of it would start.
  tag = tag or math.max(clock(cls, v), saved)
  redis.call('HSET', fk, 'v', num(math.max(v, tag)), 'c:' .. t, per)
  if redis.call('LLEN', K.lane(cls, t)) > 0 then
    redis.call('ZADD', K.lanes(cls), num(tag + cost), t)
  else
    lane_idle(cls, t, tag + cost)
  end
  return cost
end

-- A laned task of tenant t finished after `us` microseconds of device time (its
-- items' share of their batch's calls, or a backend slot's time): its tenant's tag
-- moves by that time's cost less what its claim charged, wherever the tag is (the
-- active lanes, or the saved tag of an idle tenant); the class's clock does not move.
-- Its type's per-item estimate follows the measurement (an exponential mean).
local function settle_time(cls, t, task_type, items, charged, us)
  local fk = K.fair(cls)
  local f = redis.call('HMGET', fk, 'w:' .. t, 'd:' .. task_type)
  local per, est = us / (tonumber(items) or 1), tonumber(f[2])
  est = est and est + (per - est) * EST_ALPHA or per
  redis.call('HSET', fk, 'd:' .. task_type, num(math.max(math.floor(est + 0.5), 1)))
  local delta = cost_of(us, f[1]) - charged
  if delta ~= 0 and not redis.call('ZADD', K.lanes(cls), 'XX', 'INCR', delta, t) then
    redis.call('HINCRBY', fk, 't:' .. t, delta)
  end
end

-- Remove `id` (created at `created_ms`, holding `items`) from the class list, scanning
-- from the end it is nearer by age: a fair claim takes tasks from anywhere in a long
-- backlog, and a scan from the wrong end would cost in proportion to the whole
-- backlog. `known`: the list's head {id, created_ms} when the caller has just read it.
local function unlist(cls, id, created_ms, now, items, known)
  local qk = K.queue(cls)
  local head = known and known[1] or redis.call('LINDEX', qk, 0)
  if head == id then
    redis.call('LPOP', qk)
    class_extra(cls, -extra(items))
    return
  end
  local oldest = known and tonumber(known[2])
    or head and tonumber(redis.call('HGET', K.job(head), 'created_ms'))
  local age = now - (tonumber(created_ms) or now)
  local from_tail = oldest and age * 2 < now - oldest
  if redis.call('LREM', qk, from_tail and -1 or 1, id) > 0 then class_extra(cls, -extra(items)) end
end

-- Remove a queued task (`items` of them) from its lane (a cancel, a late result): an
-- emptied lane goes idle.
local function unlane(cls, id, lane, items)
  if not lane or lane == '' then return end
  local lk = K.lane(cls, lane)
  if redis.call('LREM', lk, 1, id) > 0 then lane_extra(cls, lane, -extra(items)) end
  if redis.call('LLEN', lk) == 0 then
    local tag = redis.call('ZSCORE', K.lanes(cls), lane)
    if tag then lane_idle(cls, lane, tonumber(tag)) end
  end
end

-- Whether string a sorts before b byte by byte (as a ZSET orders equal scores; Lua's
-- own `<` follows the server's locale).
local function bytes_before(a, b)
  for i = 1, math.min(#a, #b) do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x < y end
  end
  return #a < #b
end

-- Items that work with k items of tenant t's lane before it has ahead of it in fair
-- order: those k, and from every other active lane u the items whose start tags come
-- before its own (tag_t + k x cost_t, cost_t from the estimate of the task's type,
-- each other tenant's items costing what its last one was charged; on a tie, u's
-- when u sorts first), at most the items u has queued. An estimate: later arrivals of
-- idle tenants, tasks given back and measured times move it, and only the AHEAD_LANES
-- lanes with the smallest tags are counted (a read bounded however many tenants).
local AHEAD_LANES = 64
local function fair_ahead(cls, t, k, task_type)
  -- t's items cost what its type's estimate says (its next claims will charge that),
  -- else what its last one was charged.
  local f = redis.call('HMGET', K.fair(cls), 'v', 't:' .. t, 'w:' .. t, 'c:' .. t,
    'd:' .. (task_type or ''))
  local v, saved = tonumber(f[1]) or 0, tonumber(f[2]) or 0
  -- Device time per item: the type's estimate, else t's last charge, else a turn.
  local per = tonumber(f[5]) or (tonumber(f[4]) and tonumber(f[4]) * (tonumber(f[3]) or 1))
    or TURN_US
  local cost = cost_of(per, f[3])
  local lk = K.lanes(cls)
  local mine = redis.call('ZSCORE', lk, t)
  local at = (mine and tonumber(mine) or math.max(clock(cls, v), saved)) + k * cost
  local active = redis.call('ZRANGEBYSCORE', lk, '-inf', num(at), 'WITHSCORES', 'LIMIT', 0,
    AHEAD_LANES)
  local others, fields = {}, {}
  for i = 1, #active, 2 do
    if active[i] ~= t then
      others[#others + 1] = {active[i], tonumber(active[i + 1])}
      fields[#fields + 1] = 'w:' .. active[i]
      fields[#fields + 1] = 'x:' .. active[i]
      fields[#fields + 1] = 'c:' .. active[i]
    end
  end
  local ahead = k
  if #others == 0 then return ahead end
  local wx = redis.call('HMGET', K.fair(cls), unpack(fields))
  for i, u in ipairs(others) do
    -- u's last charge; never charged yet: items like t's at u's weight.
    local cu = tonumber(wx[3 * i]) or cost_of(per, wx[3 * i - 2])
    local d = at - u[2]
    local n = math.floor(d / cu) + 1 -- u's tags u[2] + j x cu up to `at`
    if d % cu == 0 and not bytes_before(u[1], t) then n = n - 1 end -- a tie t wins
    ahead = ahead + math.min(n, items_in(redis.call('LLEN', K.lane(cls, u[1])), wx[3 * i - 1]))
  end
  return ahead
end

-- Write a final status once: the record expires after ttl, the upload goes at once
-- and its bytes (`bytes`, the job's field, counted in class `cls`) stop counting against
-- max_queued_bytes, and the task stops counting against its tenant's max_in_flight
-- (when it counted: `quota_tenant` is the tenant then, else false). Callers read
-- `cls` and `bytes` with the fields they read anyway: a task without an upload costs
-- no extra command (and no DEL: `bytes` 0 means it has none).
local function finalize(id, status, now, ttl, extra, quota_tenant, cls, bytes)
  local jk = K.job(id)
  local n = tonumber(bytes)
  if n == nil or n > 0 then redis.call('DEL', K.file(id)) end -- nil: not known, so look
  if cls and n and n > 0 then redis.call('DECRBY', K.queued_bytes(cls), n) end
  redis.call('HSET', jk, 'status', status, 'ended_at', iso(now), 'ended_ms', now, 'bytes', 0,
    unpack(extra))
  redis.call('EXPIRE', jk, ttl)
  if quota_tenant then redis.call('ZREM', K.tenant_tasks(quota_tenant), id) end
  notify(id)
end

-- Fencing. A worker's report (finish, release, progress) carries the attempt number
-- its claim returned. It holds the task only while the record's `attempts` is still
-- that number: once the reaper gave the task back and a claim started it again (on
-- another worker, or on a new process under the same name), the old run is stale.
-- Its report is dropped and counted (gpulane_reports_fenced_total{report}).
local function fenced(report)
  redis.call('HINCRBY', K.METRICS, 'c|fenced|' .. report, 1)
  return 'fenced'
end

-- Whether a report of worker w's run of attempt `attempt` comes from a run a later
-- claim superseded: another attempt started since, or this one runs elsewhere.
local function superseded(status, worker_name, attempts, w, attempt)
  return tonumber(attempts) ~= attempt or (status == 'started' and worker_name ~= w)
end

-- Whether worker w's run of attempt `attempt` is the task's current run (fields:
-- status, worker_name, attempts).
local function holds(f, w, attempt)
  return f[1] == 'started' and f[2] == w and tonumber(f[3]) == attempt
end

-- The tenant whose max_in_flight a task counts against, from its 'tenant' and 'quota'
-- fields, or false.
local function quota_of(tenant, quota)
  if quota == '1' and tenant then return tenant end
  return false
end

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
    'quota', 'type', 'bytes', 'items')
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
    finalize(id, 'canceled', now, o.ttl_s, {'lost', lost, 'history', hist, 'error',
      cjson.encode({code = 'canceled', message = 'Canceled; its worker stopped while canceling it.'})},
      quota, cls, f[9])
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
    finalize(id, 'failed', now, o.ttl_s, {'lost', lost, 'history', hist, 'error',
      cjson.encode(error)}, quota, cls, f[9])
    return 'failed', task_type, items
  end
  requeue(id, cls, o.classes, {'lost', lost, 'history', hist}, true)
  return 'requeued', task_type, items
end

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

-- Forget worker `w` and give back what it held. Returns {"id|class|type|outcome|items", ...}.
local function reap_worker(w, now, o)
  local out = {}
  -- A backend worker parks in its types' idle sets (`parks`: their names, JSON).
  local parks = redis.call('HGET', K.worker(w), 'parks')
  parks = parks and parks ~= '' and cjson.decode(parks) or {}
  for _, c in ipairs(o.classes) do
    local ik = K.inflight(w, c)
    local held = redis.call('LRANGE', ik, 0, -1)
    for i = #held, 1, -1 do -- last first: a batch goes back to the head in its order
      local id = held[i]
      local outcome, task_type, items = lose(id, c, w, now, o)
      out[#out + 1] = id .. '|' .. c .. '|' .. task_type .. '|' .. outcome .. '|' .. items
    end
    redis.call('DEL', ik)
    redis.call('ZREM', K.parked(c), w)
    for _, t in ipairs(parks) do redis.call('ZREM', K.parked_type(c, t), w) end
  end
  redis.call('DEL', K.worker(w), K.wake(w), K.control(w))
  redis.call('ZREM', K.WORKERS, w)
  rq_forget(w, o.classes)
  return out
end
