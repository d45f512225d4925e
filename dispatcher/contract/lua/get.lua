-- Read a task record and, while it is queued, its position (items ahead of it): from
-- its index in the class queue or, under fair share, the items fair order puts before
-- it (an estimate, see fair_ahead in the prelude).
-- ARGV[1]: id, ARGV[2..]: the fields to read (dispatcher.contract.jobs.RECORD_FIELDS; the
-- first is 'status', the third 'origin', the last 'lane'). Returns {values, position|nil}.
local values = redis.call('HMGET', K.job(ARGV[1]), unpack(ARGV, 2))
local position = false

-- Items in the first k of a list of len records holding x extra items: chunks are
-- taken as spread evenly (an estimate, read in O(1)).
local function items_before(k, len, x)
  if len <= 0 then return k end
  return k + math.floor(math.max(tonumber(x) or 0, 0) * k / len)
end

if values[1] == 'queued' and values[3] then
  local c, lane = values[3], values[#values]
  local lk = lane and lane ~= '' and K.lane(c, lane)
  local k = lk and redis.call('LPOS', lk, ARGV[1])
  if k then
    local x = redis.call('HGET', K.fair(c), 'x:' .. lane)
    local task_type
    for i = 2, #ARGV do if ARGV[i] == 'type' then task_type = values[i - 1] end end
    position = fair_ahead(c, lane, items_before(k, redis.call('LLEN', lk), x), task_type)
  else
    k = redis.call('LPOS', K.queue(c), ARGV[1])
    if k then
      local x = redis.call('GET', K.queued_extra(c))
      position = items_before(k, redis.call('LLEN', K.queue(c)), x)
    end
  end
end
return {values, position}
