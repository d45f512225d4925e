-- Record a task's outcome, once. If the task already ended (it ran twice after its
-- worker lost the lease), nothing changes: results are reported once. If it was
-- handed back meanwhile, it leaves the queue; if another worker runs it now, that
-- worker is told to stop.
-- ARGV[1]: {id, worker, class, status, error, progress, ttl_s}; ARGV[2]: result JSON or ''.
-- Returns {'ok', ended_ms} | {'duplicate', status} | {'gone'}.
local o = cjson.decode(ARGV[1])
local jk = K.job(o.id)
local removed = redis.call('LREM', K.inflight(o.worker, o.class), 0, o.id)
local f = redis.call('HMGET', jk, 'status', 'worker_name', 'tenant', 'quota', 'origin', 'bytes')
if not f[1] then return {'gone'} end
if FINAL[f[1]] then return {'duplicate', f[1]} end
if removed == 0 then
  redis.call('LREM', K.queue(o.class), 0, o.id)
  if f[1] == 'started' and f[2] and f[2] ~= '' and f[2] ~= o.worker then
    redis.call('RPUSH', K.control(f[2]), o.id)
  end
end
local now = now_ms()
local extra = {}
if ARGV[2] ~= '' then extra[#extra + 1] = 'result'; extra[#extra + 1] = ARGV[2] end
if o.error ~= '' then extra[#extra + 1] = 'error'; extra[#extra + 1] = o.error end
if o.progress ~= '' then extra[#extra + 1] = 'progress'; extra[#extra + 1] = o.progress end
finalize(o.id, o.status, now, o.ttl_s, extra, quota_of(f[3], f[4]), f[5], f[6])
return {'ok', now}
