-- A live worker gives its task back: at the head of its queue when shutting down past
-- the grace period, at the tail to retry it after a handler error its type allows to
-- retry. Neither counts as a lost attempt. With `fault` ({code, message}: a fatal GPU
-- error, or its device stopped answering) it counts as one, exactly like a dead
-- worker's task (lose() in lib/loss.lua), so a task that breaks every GPU still ends.
-- A release from an attempt a later claim superseded is fenced (see the prelude).
-- ARGV[1]: {id, worker, class, attempt, classes, at_head, fault?, ttl_s, max_attempts}.
-- Returns 'released', 'canceled' (a cancel was requested), with a fault 'requeued',
-- 'failed' or 'canceled', 'fenced', or what it found.
local o = cjson.decode(ARGV[1])
local f = redis.call('HMGET', K.job(o.id), 'status', 'cancel', 'tenant', 'quota', 'attempts',
  'worker_name', 'bytes', 'parent', 'part')
if f[1] and superseded(f[1], f[6], f[5], o.worker, o.attempt) then return fenced('release') end
if redis.call('LREM', K.inflight(o.worker, o.class), 0, o.id) == 0 then return 'gone' end
if f[1] ~= 'started' then return f[1] or 'gone' end
if o.fault then return (lose(o.id, o.class, o.worker, now_ms(), o, o.fault)) end
if f[2] == '1' then -- its client canceled it meanwhile: back in the queue it would run
  local now, why = now_ms(), cjson.encode({code = 'canceled', message = 'Canceled while running.'})
  finalize(o.id, 'canceled', now, o.ttl_s, {'error', why}, quota_of(f[3], f[4]), o.class, f[7])
  if f[8] then fold(f[8], tonumber(f[9]), 'canceled', '', 0, why, 0, now, o.ttl_s) end
  return 'canceled'
end
requeue(o.id, o.class, o.classes, {}, o.at_head)
return 'released'
