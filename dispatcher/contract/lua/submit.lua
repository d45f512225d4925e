-- Admit one request and enqueue it, or refuse it, in one atomic step (invariant 5): N
-- concurrent submits against max_queued = M accept exactly M items. A request is one
-- or more records of one class and tenant (a bulk submit's tasks and chunks, the
-- chunks of /v1/embeddings), admitted whole or not at all.
-- ARGV[1]: options (JSON, see dispatcher/api/store.py), with `records`, one
-- {id, type, items, timeout, gpu_mb, routed?, tpm?, encoding_format?} per record
-- (routed: only workers that declare the type take it, see claim.lua; tpm: the model
-- tokens its tenant's budget was charged, settled by tokens.lua; encoding_format: how
-- its handler is asked to give vectors, absent: float); ARGV[2 .. n+1]: each record's
-- RQ call data; ARGV[n+2]: the uploaded file's bytes ('' when there is none; a request with a
-- file has one record).
-- Limits count items (a task is one, a chunk its `items`): the class's queued items
-- plus this request's against max_queued; the estimate is the time until its last
-- item could start and run (est_ms below); `measured` false (no run time measured
-- yet) never refuses for the wait.
-- Fair share: with `lane` (the tenant, when tenants are configured) the records also
-- join the tenant's lane (see the prelude), and the position and estimate count the
-- work fair order puts ahead of it, not the whole class queue; `weight` is the tenant's.
-- Returns {'accepted', id, depth_before, est_ms, ahead, pressure}
--       | {'duplicate', id, status, class, type} | {'idempotency_key_reused', id}
--       | {'no_workers'|'queue_full'|'over_quota', '', depth, est_ms, limit, retry_s}
--       | {'device_quota', '', depth, est_ms, retry_ms, retry_s} (the tenant's `dq`, below).
-- depth: items queued in the class before this request. est_ms = -1: cannot estimate
-- (no live worker serves the class). limit (queue_full): 'depth' (max_queued), 'wait'
-- (max_wait_s) or 'bytes' (max_queued_bytes). The answer's signals are decided here,
-- once, from the same counts that admitted or refused (the API only formats them):
-- pressure ('ok' | 'high' | 'full', below) and retry_s, the Retry-After of a refusal.
-- The idempotency key holds '<id> <fingerprint>' (the sha256 of the canonical request):
-- the same key with another request is refused, never replayed.
-- A device quota (`dq`, device microseconds per rolling hour): the tenant's usage in
-- the minute buckets of the last hour, this minute's included (what the workers'
-- heartbeats wrote: work still running counts once it is reported). Over it: the ms
-- until enough of the oldest minutes have left the window; else nil.
local function over_device_quota(tenant, dq, now)
  local minute = math.floor(now / 60000)
  local per, used = {}, 0
  for m = minute - 59, minute do
    local us = tonumber(redis.call('HGET', K.usage(m), 't|' .. tenant)) or 0
    per[#per + 1] = us
    used = used + us
  end
  if used < dq then return nil end
  for i, us in ipairs(per) do -- minute - 60 + i leaves the window at minute + i
    used = used - us
    if used < dq then return (minute + i) * 60000 - now end
  end
  return (minute + 60) * 60000 - now
end

local o = cjson.decode(ARGV[1])
local records = o.records
local file = ARGV[#records + 2] or ''

if o.idem ~= '' then
  local existing = redis.call('GET', K.idem(o.tenant, o.idem))
  if existing then
    local id, fp = string.match(existing, '^(%S+) ?(%x*)$')
    local f = redis.call('HMGET', K.job(id or existing), 'status', 'origin', 'type')
    if f[1] then
      if fp and fp ~= '' and fp ~= o.fingerprint then return {'idempotency_key_reused', id} end
      return {'duplicate', id, f[1], f[2], f[3]}
    end
  end
end

local listed = redis.call('LLEN', K.queue(o.class))
local items = 0
for _, r in ipairs(records) do items = items + r.items end
local depth = 0 -- items queued in the class
if listed > 0 then
  depth = items_in(listed, redis.call('GET', K.queued_extra(o.class)))
elseif items > #records then
  -- An empty list holds no extra items: whatever a lost chunk left ends before this
  -- request's chunks count (a request of tasks alone pays no command for it).
  redis.call('DEL', K.queued_extra(o.class))
end

local ahead = depth
if o.lane ~= '' then
  local fk = K.fair(o.class)
  redis.call('HSET', fk, 'w:' .. o.lane, o.weight)
  local mine = items_in(redis.call('LLEN', K.lane(o.class, o.lane)),
    redis.call('HGET', fk, 'x:' .. o.lane))
  ahead = fair_ahead(o.class, o.lane, mine, records[1].type)
end
-- The items ahead drain at the whole class's pace (big cards take small tasks too);
-- the request's own items at the pace of the `workers` that can hold them. run_s is the
-- class's measured time per item (a batch's time shared among its items).
local est_ms = -1
if o.workers > 0 then
  est_ms = math.ceil((ahead / o.serving + items / o.workers) * o.run_s * 1000)
end

-- Retry-After of a refusal: when the same request would be accepted at the pool's
-- current pace, in whole seconds from 1 to an hour.
local NO_WORKERS_RETRY_S = 5 -- about one lease: a restarting worker is back by then
local over_wait_s = 0 -- how far the estimate is over max_wait_s: it drains 1 s a second
if o.measured and est_ms >= 0 then over_wait_s = est_ms / 1000 - o.max_wait_s end
local function refuse(verdict, limit, retry_in_s)
  return {verdict, '', depth, est_ms, limit, math.min(math.max(math.ceil(retry_in_s), 1), 3600)}
end

-- `workers`: live workers of the class whose card could hold the task; `serving`: all
-- of them. Some serve it, none could hold it: refused whatever reject_without_workers.
if o.workers == 0 and (o.reject_without_workers or o.serving > 0) then
  return refuse('no_workers', '', NO_WORKERS_RETRY_S)
end
if depth + items > o.max_queued then
  -- The items past max_queued leave at the class's pace; the wait, if measured, must
  -- also be back under max_wait_s. A class that queues without workers: one lease.
  local retry = NO_WORKERS_RETRY_S
  if o.serving > 0 then
    retry = math.max((depth + items - o.max_queued) * o.run_s / o.serving, over_wait_s)
  end
  return refuse('queue_full', 'depth', retry)
end
if over_wait_s > 0 then return refuse('queue_full', 'wait', over_wait_s) end
local size = #file
if size > 0 and size + tonumber(redis.call('GET', K.queued_bytes(o.class)) or '0') > o.max_bytes then
  return refuse('queue_full', 'bytes', o.run_s) -- about when one upload's task has run
end
local tk = K.tenant_tasks(o.tenant)
if o.max_in_flight > 0 and redis.call('ZCARD', tk) + #records > o.max_in_flight then
  return refuse('over_quota', '', o.run_s) -- about when one of its tasks ends
end

local now = now_ms()
if o.dq > 0 then
  local retry_ms = over_device_quota(o.tenant, o.dq, now)
  if retry_ms then return refuse('device_quota', retry_ms, retry_ms / 1000) end
end
local ts = iso(now)
local quota = o.max_in_flight > 0 and '1' or '0'
local has_file = size > 0 and '1' or '0'
for i, r in ipairs(records) do
  local fields = {'data', ARGV[i + 1], 'origin', o.class, 'status', 'queued',
    'created_at', ts, 'enqueued_at', ts, 'created_ms', now, 'description', r.type,
    'timeout', math.ceil(r.timeout), 'timeout_s', r.timeout, 'result_ttl', o.ttl_s,
    'failure_ttl', o.ttl_s, 'type', r.type, 'tenant', o.tenant, 'attempts', 0, 'lost', 0,
    'has_file', has_file, 'quota', quota, 'bytes', size, 'lane', o.lane, 'gpu_mb', r.gpu_mb}
  if r.items > 1 then fields[#fields + 1] = 'items'; fields[#fields + 1] = r.items end
  if r.routed then fields[#fields + 1] = 'route'; fields[#fields + 1] = '1' end
  if r.tpm then fields[#fields + 1] = 'tpm'; fields[#fields + 1] = r.tpm end
  if r.encoding_format then
    fields[#fields + 1] = 'encoding_format'; fields[#fields + 1] = r.encoding_format
  end
  redis.call('HSET', K.job(r.id), unpack(fields))
  enqueue(o.class, r.id, o.lane, false, r.items)
  if o.max_in_flight > 0 then redis.call('ZADD', tk, now, r.id) end
end
if size > 0 then
  redis.call('INCRBY', K.queued_bytes(o.class), size)
  redis.call('SET', K.file(records[1].id), file)
end
if o.idem ~= '' then
  redis.call('SET', K.idem(o.tenant, o.idem), records[1].id .. ' ' .. o.fingerprint, 'EX',
    o.idem_ttl_s)
end
-- One doorbell per record while parked workers fit (a record a worker cannot hold
-- rings nobody: see wake; a routed one rings its type's workers).
for _, r in ipairs(records) do
  if not wake(o.class, o.classes, r.gpu_mb, r.routed and r.type) and r.gpu_mb == 0
    and not r.routed then break end
end
-- The pressure the next submit meets: 'full' where it would be refused, 'high' past half
-- of a limit (the class's items against max_queued; once measured, the estimate of one
-- more item behind this request against max_wait_s), else 'ok'.
local load, full = (depth + items) / o.max_queued, depth + items >= o.max_queued
if o.measured and est_ms >= 0 then
  local next_ms = est_ms + o.run_s * 1000 / o.workers
  load = math.max(load, next_ms / (o.max_wait_s * 1000))
  full = full or next_ms > o.max_wait_s * 1000
end
local pressure = full and 'full' or (load >= 0.5 and 'high' or 'ok')
return {'accepted', records[1].id, depth, est_ms, ahead, pressure}
