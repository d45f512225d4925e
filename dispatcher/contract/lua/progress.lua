-- A running task's progress, written only by its current run (see fenced() in the
-- prelude): a stale run's progress is dropped and counted, and a record that is gone
-- is not recreated. A written one is announced to the API's waiters (notify).
-- ARGV[1]: {id, worker, attempt}; ARGV[2]: progress JSON {"fraction", "message"}.
-- Returns 1 (written) or 0 (fenced).
local o = cjson.decode(ARGV[1])
local jk = K.job(o.id)
if not holds(redis.call('HMGET', jk, 'status', 'worker_name', 'attempts'), o.worker, o.attempt) then
  fenced('progress')
  return 0
end
redis.call('HSET', jk, 'progress', ARGV[2])
notify(o.id)
return 1
