-- Queueing a task and taking it out of its lists; writing a final status.

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

-- Remove `id` (created at `created_ms`, holding `items`) from the class list, scanning
-- from the end it is nearer by age: a fair claim takes tasks from anywhere in a long
-- backlog, and a scan from the wrong end would cost in proportion to the whole
-- backlog. `known`: the list's head {id =, created_ms =} when the caller has just
-- read it.
local function unlist(cls, id, created_ms, now, items, known)
  local qk = K.queue(cls)
  local head = known and known.id or redis.call('LINDEX', qk, 0)
  if head == id then
    redis.call('LPOP', qk)
    class_extra(cls, -extra(items))
    return
  end
  local oldest = known and tonumber(known.created_ms)
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
