-- Items queued: a list's records plus their chunks' extra items.

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
