-- Read a task record and, while it is queued, its position (tasks ahead of it).
-- ARGV[1]: id, ARGV[2..]: the fields to read (dispatcher.contract.jobs.RECORD_FIELDS; the
-- first is 'status', the third 'origin'). Returns {values, position|nil}.
local values = redis.call('HMGET', K.job(ARGV[1]), unpack(ARGV, 2))
local position = false
if values[1] == 'queued' and values[3] then
  position = redis.call('LPOS', K.queue(values[3]), ARGV[1])
end
return {values, position}
