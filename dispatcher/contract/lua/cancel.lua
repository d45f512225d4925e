-- Cancel a task. Queued: it leaves the queue (and its tenant's lane) and ends 'canceled' now. Running: the
-- worker holding it is told through its control list (it acts within a heartbeat).
-- ARGV[1]: {id, tenant, any_tenant (true: admins, who may cancel any tenant's task), ttl_s}.
-- The tenant must match exactly unless any_tenant is true; '' is never a wildcard.
-- Returns {'canceled', class, type, items} | {'cancel_requested'} | {'conflict', status}
--       | {'not_found'}.
local o = cjson.decode(ARGV[1])
local jk = K.job(o.id)
local f = redis.call('HMGET', jk, 'status', 'tenant', 'origin', 'worker_name', 'quota', 'type',
  'bytes', 'lane', 'created_ms', 'items')
if not f[1] or (o.any_tenant ~= true and f[2] ~= o.tenant) then return {'not_found'} end
if FINAL[f[1]] then return {'conflict', f[1]} end
if f[1] == 'queued' then
  local now = now_ms()
  unlist(f[3], o.id, f[9], now, f[10])
  unlane(f[3], o.id, f[8], f[10])
  finalize(o.id, 'canceled', now, o.ttl_s, {'error', cjson.encode({code = 'canceled',
    message = 'Canceled before it started.'})}, quota_of(f[2], f[5]), f[3], f[7])
  return {'canceled', f[3] or '-', f[6] or '-', tonumber(f[10]) or 1}
end
redis.call('HSET', jk, 'cancel', '1')
notify(o.id) -- cancel_requested turned true
if f[4] and f[4] ~= '' then redis.call('RPUSH', K.control(f[4]), o.id) end
return {'cancel_requested'}
