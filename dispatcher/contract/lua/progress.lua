-- A running task's progress, written only by its current run (see fenced() in the
-- prelude): a stale run's progress is dropped and counted, and a record that is gone
-- is not recreated. A written one is announced to the API's waiters (notify).
-- A part's progress moves its parent's too (the parts' fractions summed).
-- ARGV[1]: {id, worker, attempt, fraction}; ARGV[2]: progress JSON {"fraction", "message"}.
-- Returns 1 (written) or 0 (fenced).
local o = cjson.decode(ARGV[1])
local jk = K.job(o.id)
local f = redis.call('HMGET', jk, 'status', 'worker_name', 'attempts', 'parent', 'pf')
if not holds(f, o.worker, o.attempt) then
  fenced('progress')
  return 0
end
if f[4] then
  redis.call('HSET', jk, 'progress', ARGV[2], 'pf', o.fraction)
  part_progress(f[4], tonumber(f[5]) or 0, o.fraction)
else
  redis.call('HSET', jk, 'progress', ARGV[2])
end
notify(o.id, 'progress')
return 1
