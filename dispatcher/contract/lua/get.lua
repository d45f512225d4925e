-- Read a task record and, while it is queued, its position (tasks ahead of it): its
-- index in the class queue or, under fair share, the tasks fair order puts before it
-- (an estimate, see fair_ahead in the prelude).
-- ARGV[1]: id, ARGV[2..]: the fields to read (dispatcher.contract.jobs.RECORD_FIELDS; the
-- first is 'status', the third 'origin', the last 'lane'). Returns {values, position|nil}.
local values = redis.call('HMGET', K.job(ARGV[1]), unpack(ARGV, 2))
local position = false
if values[1] == 'queued' and values[3] then
  local lane = values[#values]
  local k = lane and lane ~= '' and redis.call('LPOS', K.lane(values[3], lane), ARGV[1])
  if k then
    position = fair_ahead(values[3], lane, k)
  else
    position = redis.call('LPOS', K.queue(values[3]), ARGV[1])
  end
end
return {values, position}
