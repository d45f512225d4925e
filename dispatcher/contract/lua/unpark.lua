-- A worker stops taking tasks (it is stopping or unhealthy): it leaves the idle sets,
-- so no submit rings its doorbell any more, and a doorbell it may have taken on its way
-- out is passed on: each class with queued work wakes another parked worker.
-- ARGV[1]: {worker, classes (all configured)}. Returns the number of workers woken.
local o = cjson.decode(ARGV[1])
for _, c in ipairs(o.classes) do redis.call('ZREM', K.parked(c), o.worker) end
redis.call('DEL', K.wake(o.worker))
local woken = 0
for _, c in ipairs(o.classes) do
  local head = redis.call('LINDEX', K.queue(c), 0) -- wake one that can hold it
  if head and wake(c, o.classes, redis.call('HGET', K.job(head), 'gpu_mb')) then
    woken = woken + 1
  end
end
return woken
