-- A worker stops taking tasks (it is stopping or unhealthy): it leaves the idle sets,
-- so no submit rings its doorbell any more, and a doorbell it may have taken on its way
-- out is passed on: each class with queued work wakes another parked worker.
-- ARGV[1]: {worker, classes (all configured), types? (a backend worker's: it parks in
-- their idle sets)}. Returns the number of workers woken.
local o = cjson.decode(ARGV[1])
for _, c in ipairs(o.classes) do
  redis.call('ZREM', K.parked(c), o.worker)
  for _, t in ipairs(o.types or {}) do redis.call('ZREM', K.parked_type(c, t), o.worker) end
end
redis.call('DEL', K.wake(o.worker))
local woken = 0
for _, c in ipairs(o.classes) do
  local head = redis.call('LINDEX', K.queue(c), 0) -- wake one that can hold it
  local f = head and redis.call('HMGET', K.job(head), 'gpu_mb', 'route', 'type')
  if f and wake(c, o.classes, f[1], f[2] == '1' and f[3]) then
    woken = woken + 1
  end
end
return woken
