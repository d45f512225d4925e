-- Parked workers' scores and the doorbell a submit or a requeue rings.

-- A parked worker's score in the idle sets: its rank (round(1000 / its speed): faster
-- is lower) above, the GPU memory it has free for a task (MB, NO_LIMIT without a GPU)
-- below. The lowest score is the fastest worker, and among equally fast ones the one
-- with the least memory free (best fit: big cards stay free for what only they hold).
local MEM_SPAN = 4294967296 -- 2^32: memory fits below it; scores stay exact doubles
local NO_LIMIT = 2147483647 -- MB: "no limit" (a cpu worker)
local function park_score(rank, mem)
  return num((tonumber(rank) or 1000) * MEM_SPAN + math.min(tonumber(mem) or NO_LIMIT, NO_LIMIT))
end

-- Ring the doorbell of the first parked worker of this class (by score, above) whose
-- GPU has `need` MB free (0 or nil: any worker). It leaves every idle set, so a second
-- task does not wake the same worker while another one sits idle. None fits: nobody is
-- rung; a worker finishing its task, or a parked one's periodic look, takes it.
-- A routed record (`routed`: its type, served only by the workers that declare it:
-- backend workers, one type per backend model) rings from that type's idle set
-- instead, gpulane:parked:<class>:<type>.
local SPEED_BANDS = 16 -- distinct speeds looked through for a task that needs memory
local function wake(cls, classes, need, routed)
  local function parked(c) return routed and K.parked_type(c, routed) or K.parked(c) end
  local ik = parked(cls)
  local w
  need = tonumber(need) or 0
  if need > 0 then
    -- The first worker scored at least band + need is, in its band, the fastest with
    -- room; or it is in a slower band, which is then searched the same way.
    local from = need
    for _ = 1, SPEED_BANDS do
      local hit = redis.call('ZRANGEBYSCORE', ik, num(from), '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
      if not hit[1] then break end
      local band = math.floor(tonumber(hit[2]) / MEM_SPAN) * MEM_SPAN
      if tonumber(hit[2]) - band >= need then w = hit[1]; break end
      from = band + need
    end
    if w then redis.call('ZREM', ik, w) end
  else
    w = redis.call('ZPOPMIN', ik)[1] -- one command: the usual doorbell costs no more
  end
  if w then
    for _, c in ipairs(classes) do
      if c ~= cls then redis.call('ZREM', parked(c), w) end
    end
    redis.call('LPUSH', K.wake(w), '1')
  end
  return w
end
