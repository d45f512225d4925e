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
