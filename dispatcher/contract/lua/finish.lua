-- Record a task's outcome, once, and only from its current attempt. A report from an
-- attempt that a later claim superseded (its worker lost the lease, the task ran
-- again) is fenced: dropped and counted, the record untouched, the in-flight list of
-- the current run left alone. If the task already ended, nothing changes: results are
-- reported once. If it was handed back meanwhile and nobody started it again, the
-- result is kept and it leaves the queue (and its tenant's lane).
-- Under fair share, a laned task's measured device time (`device_us`, sent when fair
-- share counts device time) settles what its claim charged its tenant (settle_time).
-- ARGV[1]: {id, worker, class, attempt, status, error, progress, ttl_s, device_us?};
-- ARGV[2]: result JSON or ''.
-- Returns {'ok', ended_ms} | {'duplicate', status} | {'gone'} | {'fenced'}.
local o = cjson.decode(ARGV[1])
local jk = K.job(o.id)
local ik = K.inflight(o.worker, o.class)
local f = redis.call('HMGET', jk, 'status', 'worker_name', 'tenant', 'quota', 'attempts',
  'origin', 'bytes', 'lane', 'created_ms', 'items', 'fc', 'type')
if not f[1] then
  redis.call('LREM', ik, 0, o.id)
  return {'gone'}
end
if superseded(f[1], f[2], f[5], o.worker, o.attempt) then return {fenced('finish')} end
local removed = redis.call('LREM', ik, 0, o.id)
if FINAL[f[1]] then return {'duplicate', f[1]} end
local now = now_ms()
if removed == 0 then -- handed back, queued again: it leaves the queue and its lane
  unlist(o.class, o.id, f[9], now, f[10])
  unlane(o.class, o.id, f[8], f[10])
end
local charged = tonumber(f[11])
if o.device_us and charged and charged > 0 and f[8] and f[8] ~= '' then
  settle_time(o.class, f[8], f[12] or '-', f[10], charged, o.device_us)
end
local extra = {}
if ARGV[2] ~= '' then extra[#extra + 1] = 'result'; extra[#extra + 1] = ARGV[2] end
if o.error ~= '' then extra[#extra + 1] = 'error'; extra[#extra + 1] = o.error end
if o.progress ~= '' then extra[#extra + 1] = 'progress'; extra[#extra + 1] = o.progress end
finalize(o.id, o.status, now, o.ttl_s, extra, quota_of(f[3], f[4]), f[6], f[7])
return {'ok', now}
