-- Fair share among tenants: lanes, tags, the virtual clock, charge and settle, positions.

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
