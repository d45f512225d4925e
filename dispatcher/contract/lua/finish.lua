-- Record a task's outcome, once, and only from its current attempt. A report from an
-- attempt that a later claim superseded (its worker lost the lease, the task ran
-- again) is fenced: dropped and counted, the record untouched, the in-flight list of
-- the current run left alone. If the task already ended, nothing changes: results are
-- reported once. If it was handed back meanwhile and nobody started it again, the
-- result is kept and it leaves the queue (and its tenant's lane).
-- Under fair share, a laned task's measured device time (`device_us`, sent when fair
-- share counts device time) settles what its claim charged its tenant (settle_time).
-- A part (of a task split into parts) keeps no result of its own: its entries (the
-- result JSON, a list of `entries` entries) go to its parent's parts (fold(), in
-- lib/parts.lua), which may end the parent.
-- ARGV[1]: {id, worker, class, attempt, status, error, progress, ttl_s, device_us?,
--           entries? (a part's)}; ARGV[2]: result JSON or ''.
-- Returns {'ok', ended_ms} | {'duplicate', status} | {'gone'} | {'fenced'}.
local o = cjson.decode(ARGV[1])
local stop, f, now = arrive('finish', o, {'tenant', 'quota', 'origin', 'bytes', 'fc', 'type',
  'parent', 'part', 'pf'})
if stop then return stop end
local charged = tonumber(f.fc)
if o.device_us and charged and charged > 0 and f.lane and f.lane ~= '' then
  settle_time(o.class, f.lane, f.type or '-', f.items, charged, o.device_us)
end
local parent = f.parent
local extra = {}
if ARGV[2] ~= '' and not parent then extra[#extra + 1] = 'result'; extra[#extra + 1] = ARGV[2] end
if o.error ~= '' then extra[#extra + 1] = 'error'; extra[#extra + 1] = o.error end
if o.progress ~= '' then extra[#extra + 1] = 'progress'; extra[#extra + 1] = o.progress end
finalize(o.id, o.status, now, o.ttl_s, extra, quota_of(f.tenant, f.quota), f.origin, f.bytes)
if parent then
  fold(parent, tonumber(f.part), o.status, ARGV[2], tonumber(o.entries) or 0, o.error, f.pf, now,
    o.ttl_s)
end
return {'ok', now}
