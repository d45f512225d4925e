-- A task split into parts (dispatcher/contract/parts.py): a part's end folded into its
-- parent, the parent's progress, and stopping the parts of a parent that ended.

local function count_end(cls, task_type, public)
  redis.call('HINCRBY', K.METRICS, 'c|finished|' .. (cls or '-') .. '|' .. (task_type or '-') ..
    '|' .. public, 1)
end

-- The parent's progress: its parts' fractions summed (`psum`) over its `n` parts.
local function parent_progress(pk, psum, n, done)
  local fraction = math.floor(math.min(psum / math.max(n, 1), 1) * 10000 + 0.5) / 10000
  redis.call('HSET', pk, 'progress', cjson.encode({fraction = fraction,
    message = done .. ' of ' .. n .. ' parts done'}))
end

-- A running part's progress went from `old` to `new` (fractions): so does its parent's.
local function part_progress(pid, old, new)
  local pk = K.job(pid)
  local p = redis.call('HMGET', pk, 'status', 'parts', 'left')
  if not p[1] or FINAL[p[1]] then return end
  local n = tonumber(p[2]) or 1
  local psum = tonumber(redis.call('HINCRBYFLOAT', pk, 'psum', new - old))
  parent_progress(pk, psum, n, n - (tonumber(p[3]) or n))
  notify(pid)
end

-- Stop part `cid` of a parent that ended: a queued one ends canceled now (counted
-- here: no worker reports it), a running one is told to stop; its report then finds
-- the parent final and changes nothing there.
local function stop_part(cid, now, ttl, why)
  local f = redis.call('HMGET', K.job(cid), 'status', 'origin', 'lane', 'created_ms', 'items',
    'worker_name', 'type')
  if not f[1] or FINAL[f[1]] then return end
  if f[1] == 'queued' then
    unlist(f[2], cid, f[4], now, f[5])
    unlane(f[2], cid, f[3], f[5])
    finalize(cid, 'canceled', now, ttl, {'error', cjson.encode({code = 'canceled',
      message = why})}, false, f[2], 0)
    count_end(f[2], f[7], 'canceled')
    return
  end
  redis.call('HSET', K.job(cid), 'cancel', '1')
  notify(cid)
  if f[6] and f[6] ~= '' then redis.call('RPUSH', K.control(f[6]), cid) end
end

-- Parent `pid` of `n` parts ended before its parts did: stop them. The results its
-- parts stored are kept as long as its record (each part's record still reads its own).
local function stop_parts(pid, n, now, ttl, why)
  for k = 0, n - 1 do stop_part(part_id(pid, k), now, ttl, why) end
  redis.call('EXPIRE', K.parts(pid), ttl)
end

local PARENT = {'status', 'parts', 'left', 'tenant', 'quota', 'origin', 'bytes', 'type'}

-- Part `k` of parent `pid` ended with RQ status `status`: 'finished' with `entries`
-- entries (`json`, a JSON list; `pf` its last progress fraction), or failed or
-- canceled with `err` (its error's JSON). The last part to succeed ends the parent
-- succeeded; the first that fails ends it failed, naming the part, and stops the
-- others. A parent already final (canceled, failed by another part) takes nothing.
local function fold(pid, k, status, json, entries, err, pf, now, ttl)
  local pk = K.job(pid)
  local p = redis.call('HMGET', pk, unpack(PARENT))
  if not p[1] or FINAL[p[1]] then return end
  local n = tonumber(p[2]) or 0
  local quota = quota_of(p[4], p[5])
  if status ~= 'finished' then
    local ok, e = pcall(cjson.decode, err or '')
    if not ok or type(e) ~= 'table' then e = {} end
    local perr = cjson.encode({code = e.code or 'task_error', part = k,
      message = 'Part ' .. k .. ' of ' .. n .. ' ended ' .. status .. ': ' .. (e.message or '')})
    finalize(pid, 'failed', now, ttl, {'error', perr}, quota, p[6], p[7])
    count_end(p[6], p[8], 'failed')
    stop_parts(pid, n, now, ttl, 'Canceled: part ' .. k .. ' of the same task failed.')
    return
  end
  redis.call('HSET', K.parts(pid), k, json, 'n:' .. k, entries)
  redis.call('HINCRBY', pk, 'entries', entries)
  redis.call('HINCRBY', pk, 'pbytes', #json)
  local left = redis.call('HINCRBY', pk, 'left', -1)
  local psum = tonumber(redis.call('HINCRBYFLOAT', pk, 'psum', 1 - (tonumber(pf) or 0)))
  if left > 0 then
    parent_progress(pk, psum, n, n - left)
    notify(pid)
    return
  end
  finalize(pid, 'finished', now, ttl, {'progress', cjson.encode({fraction = 1,
    message = n .. ' of ' .. n .. ' parts done'})}, quota, p[6], p[7])
  redis.call('EXPIRE', K.parts(pid), ttl)
  count_end(p[6], p[8], 'succeeded')
end
