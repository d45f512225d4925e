-- Record the outcomes of a worker's runs (a batch's records, or a task alone), each
-- once, and only from its current attempt. A report from an attempt that a later claim
-- superseded (its worker lost the lease, the task ran again) is fenced: dropped and
-- counted, the record untouched, the in-flight list of the current run left alone. If
-- the task already ended, nothing changes: results are reported once. If it was handed
-- back meanwhile and nobody started it again, the result is kept and it leaves the
-- queue (and its tenant's lane).
-- Under fair share, a laned task's measured device time (`device_us`, sent when fair
-- share counts device time) settles what its claim charged its tenant (settle_time).
-- A part (of a task split into parts) keeps no result of its own: its entries (the
-- result JSON, a list of `entries` entries) go to its parent's parts (fold(), in
-- lib/parts.lua), which may end the parent.
-- One call for many records: the script's own cost (its libraries, the call) is paid
-- once, not per record (a third of a record's finish when each had its own call).
-- Each record stands alone, as if it had its own call: an error in one (pcall) is its
-- reply, {'error', message}, and the others are recorded. Like a script that errors,
-- it keeps what it wrote before the error (Redis does not roll a script back).
-- ARGV[1]: [{id, worker, class, attempt, status, error, progress, ttl_s, device_us?,
--            entries? (a part's)}, ...]; ARGV[1 + i]: record i's result JSON or ''.
-- Returns, per record: {'ok', ended_ms} | {'duplicate', status} | {'gone'} | {'fenced'}
-- | {'error', message}.

local function finish(o, result)
  local stop, f, now = arrive('finish', o, {'tenant', 'quota', 'origin', 'bytes', 'fc', 'type',
    'parent', 'part', 'pf'})
  if stop then return stop end
  local charged = tonumber(f.fc)
  if o.device_us and charged and charged > 0 and f.lane and f.lane ~= '' then
    settle_time(o.class, f.lane, f.type or '-', f.items, charged, o.device_us)
  end
  local parent = f.parent
  local extra = {}
  if result ~= '' and not parent then extra[#extra + 1] = 'result'; extra[#extra + 1] = result end
  if o.error ~= '' then extra[#extra + 1] = 'error'; extra[#extra + 1] = o.error end
  if o.progress ~= '' then extra[#extra + 1] = 'progress'; extra[#extra + 1] = o.progress end
  finalize(o.id, o.status, now, o.ttl_s, extra, quota_of(f.tenant, f.quota), f.origin, f.bytes)
  if parent then
    fold(parent, tonumber(f.part), o.status, result, tonumber(o.entries) or 0, o.error, f.pf, now,
      o.ttl_s)
  end
  return {'ok', now}
end

local records = cjson.decode(ARGV[1])
if #records == 0 or #records ~= #ARGV - 1 then -- an object (one record, unlisted) has no length
  error('finish takes a list of records and a result argument for each')
end
local out = {}
for i, o in ipairs(records) do
  local ok, reply = pcall(finish, o, ARGV[1 + i])
  if not ok then -- an error is its message, or a table holding it in `err`
    reply = {'error', type(reply) == 'table' and tostring(reply.err) or tostring(reply)}
  end
  out[i] = reply
end
return out
