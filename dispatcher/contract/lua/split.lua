-- A running task splits into parts (its handler returned ctx.map): in one atomic step
-- its parts are written and queued at the head of its class (and of its tenant's
-- lane), part 0 first, parked workers are rung, and the task leaves this worker's
-- in-flight list. It stays running to its clients until its parts end (fold() in
-- lib/parts.lua). Fenced like finish.lua: only the current attempt splits, once; a
-- task canceled meanwhile ends canceled instead.
-- Parts inherit the task's class, tenant (quotas, usage), lane (fair share) and
-- timeout; they do not count against max_in_flight (the task does, until it ends).
-- ARGV[1]: {id, worker, class, attempt, classes, ttl_s, type (the parts'), gpu_mb,
--           merge, flatten, first, result (JSON: the task's own result fields), file
--           (true: the parts read the task's upload), labels?};
-- ARGV[2 .. n+1]: each part's call data.
-- Returns {'ok', now} | {'duplicate', status} | {'gone'} | {'fenced'}.
local o = cjson.decode(ARGV[1])
local jk = K.job(o.id)
local stop, f, now = arrive('split', o, {'tenant', 'timeout_s', 'cancel', 'quota', 'bytes'})
if stop then return stop end
if f.cancel == '1' then -- canceled while it was deciding how to split
  finalize(o.id, 'canceled', now, o.ttl_s, {'error', cjson.encode({code = 'canceled',
    message = 'Canceled while running.'})}, quota_of(f.tenant, f.quota), o.class, f.bytes)
  return {'duplicate', 'canceled'}
end
local n = #ARGV - 1
local ts = iso(now)
-- A part is as old as its task (what queue waits and aging count; and unlist finds a
-- part at the head from the head, as it finds old tasks).
local created = tonumber(f.created_ms) or now
local lane = f.lane or ''
local flatten = o.flatten and '1' or '0'
for k = n - 1, 0, -1 do -- last first: each goes to the head, so part 0 is taken first
  local label = o.labels and o.labels[k + 1] or o.type
  redis.call('HSET', K.job(part_id(o.id, k)), 'data', ARGV[k + 2], 'origin', o.class,
    'status', 'queued', 'created_at', iso(created), 'enqueued_at', ts, 'created_ms', created,
    'description', label, 'timeout', math.ceil(tonumber(f.timeout_s) or 0), 'timeout_s', f.timeout_s or '',
    'result_ttl', o.ttl_s, 'failure_ttl', o.ttl_s, 'type', o.type, 'tenant', f.tenant or '',
    'attempts', 0, 'lost', 0, 'has_file', o.file and '1' or '0', 'quota', '0', 'bytes', 0,
    'lane', lane, 'gpu_mb', o.gpu_mb, 'parent', o.id, 'part', k, 'merge', o.merge,
    'flatten', flatten, 'pf', 0)
  enqueue(o.class, part_id(o.id, k), lane, true, 1)
end
redis.call('HSET', jk, 'parts', n, 'left', n, 'entries', 0, 'pbytes', 0, 'psum', 0,
  'merge', o.merge, 'flatten', flatten, 'first', o.first, 'result', o.result)
parent_progress(jk, 0, n, 0)
redis.call('HINCRBY', K.METRICS, 'c|submitted|' .. o.class .. '|' .. o.type, n)
for _ = 1, n do
  if not wake(o.class, o.classes, o.gpu_mb, false) then break end
end
notify(o.id)
return {'ok', now}
