-- GPU claims: which worker may pin which card. A claim slot is one key holding the
-- worker's name with a PX lease; a dead worker's claim expires by itself.
-- ARGV[1]: {op, worker, ttl_ms, slots = {{uuid, slot}, ...}}
--   take:    hold the first slot (in the given order) that is free or already this
--            worker's (SET NX PX, plus: a restarted process of the same name, which
--            register.lua proved unique, takes its own claim back without waiting).
--            Returns {n} (1-based index of the slot taken) or {0, holder, holder, ...}.
--   renew:   compare-and-renew the one slot: 'held' (ours, lease extended), 'retaken'
--            (it had expired and nobody took it: ours again) or the holder's name.
--   release: compare-and-delete the one slot: 1 if it was ours, else 0.
local o = cjson.decode(ARGV[1])

local function hold(s)
  local key = K.gpu_claim(s[1], s[2])
  local holder = redis.call('GET', key)
  if holder and holder ~= o.worker then return holder end
  redis.call('SET', key, o.worker, 'PX', o.ttl_ms)
  return holder and 'held' or 'retaken'
end

if o.op == 'take' then
  local holders = {0}
  for i, s in ipairs(o.slots) do
    local got = hold(s)
    if got == 'held' or got == 'retaken' then return {i} end
    holders[#holders + 1] = got
  end
  return holders
elseif o.op == 'renew' then
  return hold(o.slots[1])
elseif o.op == 'release' then
  local key = K.gpu_claim(o.slots[1][1], o.slots[1][2])
  if redis.call('GET', key) == o.worker then return redis.call('DEL', key) end
  return 0
end
return redis.error_reply('gpu_lease: unknown op ' .. tostring(o.op))
