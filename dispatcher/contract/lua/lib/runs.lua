-- A report's fencing and the tenant a task counts against.

-- Fencing. A worker's report (finish, release, progress) carries the attempt number
-- its claim returned. It holds the task only while the record's `attempts` is still
-- that number: once the reaper gave the task back and a claim started it again (on
-- another worker, or on a new process under the same name), the old run is stale.
-- Its report is dropped and counted (gpulane_reports_fenced_total{report}).
local function fenced(report)
  redis.call('HINCRBY', K.METRICS, 'c|fenced|' .. report, 1)
  return 'fenced'
end

-- Whether a report of worker w's run of attempt `attempt` comes from a run a later
-- claim superseded: another attempt started since, or this one runs elsewhere.
local function superseded(status, worker_name, attempts, w, attempt)
  return tonumber(attempts) ~= attempt or (status == 'started' and worker_name ~= w)
end

-- Whether worker w's run of attempt `attempt` is the task's current run (fields:
-- status, worker_name, attempts).
local function holds(f, w, attempt)
  return f[1] == 'started' and f[2] == w and tonumber(f[3]) == attempt
end

-- The tenant whose max_in_flight a task counts against, from its 'tenant' and 'quota'
-- fields, or false.
local function quota_of(tenant, quota)
  if quota == '1' and tenant then return tenant end
  return false
end

-- A worker's closing report (finish, split) arriving for task o.id. Reads the record's
-- `status`, `worker_name`, `attempts`, `lane`, `created_ms`, `items` and the names in
-- `more` into a table by name, and settles where the run stands: the task gone, a
-- superseded run (fenced), a task that already ended (reported once), or one handed
-- back meanwhile and queued again (it leaves its queue and lane: the report stands).
-- Returns nil, the fields and the time; or, for a report that stops here, its reply.
local function arrive(report, o, more)
  local names = {'status', 'worker_name', 'attempts', 'lane', 'created_ms', 'items'}
  for _, name in ipairs(more) do names[#names + 1] = name end
  local ik = K.inflight(o.worker, o.class)
  local v = redis.call('HMGET', K.job(o.id), unpack(names))
  if not v[1] then
    redis.call('LREM', ik, 0, o.id)
    return {'gone'}
  end
  local f = {}
  for i, name in ipairs(names) do f[name] = v[i] end
  if superseded(f.status, f.worker_name, f.attempts, o.worker, o.attempt) then
    return {fenced(report)}
  end
  local removed = redis.call('LREM', ik, 0, o.id)
  if FINAL[f.status] then return {'duplicate', f.status} end
  local now = now_ms()
  if removed == 0 then
    unlist(o.class, o.id, f.created_ms, now, f.items)
    unlane(o.class, o.id, f.lane, f.items)
  end
  return nil, f, now
end
