-- Cancel a task. Queued: it leaves the queue (and its tenant's lane) and ends 'canceled' now. Running: the
-- worker holding it is told through its control list (it acts within a heartbeat).
-- Split into parts (running, no worker holds it): it ends 'canceled' now and its parts
-- are stopped (lib/parts.lua). A part itself is refused: its parent is what a client
-- cancels (a canceled part would fail the parent anyway).
-- ARGV[1]: {id, tenant, any_tenant (true: admins, who may cancel any tenant's task), ttl_s}.
-- The tenant must match exactly unless any_tenant is true; '' is never a wildcard.
-- Returns {'canceled', class, type, items} | {'cancel_requested'} | {'conflict', status}
--       | {'part_of', parent} | {'not_found'}.
local o = cjson.decode(ARGV[1])
local jk = K.job(o.id)
local f = redis.call('HMGET', jk, 'status', 'tenant', 'origin', 'worker_name', 'quota', 'type',
  'bytes', 'lane', 'created_ms', 'items', 'parent', 'parts')
if not f[1] or (o.any_tenant ~= true and f[2] ~= o.tenant) then return {'not_found'} end
if FINAL[f[1]] then return {'conflict', f[1]} end
if f[11] then return {'part_of', f[11]} end
local now = now_ms()
if f[1] == 'queued' or f[12] then
  local why = f[12] and 'Canceled while its parts ran.' or 'Canceled before it started.'
  if f[1] == 'queued' then
    unlist(f[3], o.id, f[9], now, f[10])
    unlane(f[3], o.id, f[8], f[10])
  end
  finalize(o.id, 'canceled', now, o.ttl_s, {'error', cjson.encode({code = 'canceled',
    message = why})}, quota_of(f[2], f[5]), f[3], f[7])
  if f[12] then stop_parts(o.id, tonumber(f[12]), now, o.ttl_s, 'Canceled with its task.') end
  return {'canceled', f[3] or '-', f[6] or '-', tonumber(f[10]) or 1}
end
redis.call('HSET', jk, 'cancel', '1')
notify(o.id) -- cancel_requested turned true
if f[4] and f[4] ~= '' then redis.call('RPUSH', K.control(f[4]), o.id) end
return {'cancel_requested'}
