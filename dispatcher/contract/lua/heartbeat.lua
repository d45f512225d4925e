-- A worker's periodic report: renew its lease, publish what it is and does (in its
-- gpulane hash and in RQ's worker registry), fold in the metrics and run-time samples
-- gathered since the last beat, and collect the cancel requests addressed to it.
-- ARGV[1]: {worker, ttl_ms, tau_s, info {field: string}, counters {field: int},
--           floats {field: number}, runs {class: [sum_run_s, count]}, rq (see rq_publish),
--           usage {'<tenant>|<class>|<type>': device microseconds}, usage_ttl_s,
--           task? {id, attempt}: the run in progress,
--           seq?: the beat's name, ack?: the cancels the last answered beat got}
-- Returns {renewed (0: the lease had been reaped), {task ids to cancel}, held (0: the
-- run in progress is no longer the task's current attempt: the worker stops it)}.
--
-- A beat whose reply was lost is sent again with the same `seq`, folds and `ack`: what
-- it folds (counters, samples, usage) counts once. Cancels stay on the control list
-- until a later beat says they arrived (`ack`, by id: the reaper may have emptied the
-- list since, and new ones come after), so a lost reply loses none.

-- Fold in what the worker gathered since its last beat.
local function fold(o, now)
  for field, n in pairs(o.counters) do redis.call('HINCRBY', K.METRICS, field, n) end
  for field, x in pairs(o.floats) do redis.call('HINCRBYFLOAT', K.METRICS, field, x) end

  -- Run time per class as an exponentially decayed mean (time constant tau_s): the
  -- weights decay with time, not with the number of reports, so many workers reporting
  -- at once weigh their samples fairly and the mean follows a change of task sizes
  -- within a minute.
  for cls, s in pairs(o.runs) do
    local sk = K.stats(cls)
    local cur = redis.call('HMGET', sk, 'sum', 'weight', 'at_ms')
    local decay = 1
    if cur[3] then decay = math.exp(-math.max(now - tonumber(cur[3]), 0) / 1000 / o.tau_s) end
    redis.call('HSET', sk, 'sum', (tonumber(cur[1]) or 0) * decay + s[1],
      'weight', (tonumber(cur[2]) or 0) * decay + s[2], 'at_ms', now)
  end

  -- Device time used since the last beat: the pool's counter (seconds) and this
  -- minute's usage bucket (exact microseconds, for GET /usage and device quotas). The
  -- minute is the beat's, by Redis' clock: a minute that has ended gets no more writes.
  if o.usage and next(o.usage) then
    local minute = math.floor(now / 60000)
    local uk = K.usage(minute)
    for field, us in pairs(o.usage) do
      redis.call('HINCRBYFLOAT', K.METRICS, 'c|device|' .. field, us / 1e6)
      redis.call('HINCRBY', uk, 'u|' .. field, us)
      redis.call('HINCRBY', uk, 't|' .. string.match(field, '^[^|]*'), us)
    end
    redis.call('EXPIRE', uk, o.usage_ttl_s)
    redis.call('ZADD', K.USAGE_MINUTES, minute, minute)
    redis.call('ZREMRANGEBYSCORE', K.USAGE_MINUTES, '-inf', minute - math.ceil(o.usage_ttl_s / 60))
  end
end

local o = cjson.decode(ARGV[1])
local now = now_ms()
local added = redis.call('ZADD', K.WORKERS, now + o.ttl_ms, o.worker)
local seq = o.seq or ''
-- The name of the last beat folded in: a key of its own, which outlives the worker
-- hash (a reaper pass or a re-register deletes that) by an hour.
local fresh = seq == '' or redis.call('GET', K.beat(o.worker)) ~= seq
if o.ack then
  for _, id in ipairs(o.ack) do redis.call('LREM', K.control(o.worker), 1, id) end
end

local info = {'last_heartbeat_ms', now}
for k, v in pairs(o.info) do info[#info + 1] = k; info[#info + 1] = v end
redis.call('HSET', K.worker(o.worker), unpack(info))
rq_publish(o.worker, now, o.ttl_ms, o.rq)

if fresh then
  fold(o, now)
  -- After the fold: a fold that fails part-way is not taken for done.
  if seq ~= '' then redis.call('SET', K.beat(o.worker), seq, 'EX', 3600) end
end

local cancels = redis.call('LRANGE', K.control(o.worker), 0, -1)

local held = 1
if o.task then
  local f = redis.call('HMGET', K.job(o.task.id), 'status', 'worker_name', 'attempts')
  -- Stricter than finish.lua's fencing on purpose: a run whose task was handed back
  -- stops now rather than hold a GPU the task's next run will need.
  if not holds(f, o.worker, o.task.attempt) then held = 0 end
end
return {1 - added, cancels, held}
