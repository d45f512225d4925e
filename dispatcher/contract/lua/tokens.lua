-- A tenant's budget of model tokens per minute (`tpm`), a token bucket held in Redis so
-- every API replica shares it: it refills at tpm / 60 s up to tpm.
-- op 'take' (the API, at admission): charge `n` (the request's max_tokens plus its
--   prompt's estimate) when the bucket holds that many, or when it is full (a request
--   larger than the whole budget still runs, alone); the bucket may go below zero.
--   ARGV[1]: {op, tenant, tpm, n}. Returns {1, tokens left} or {0, ms until it fits}.
-- op 'give' (the API: a request charged and then refused): put `n` back.
--   ARGV[1]: {op, tenant, n}. Returns 1.
-- op 'settle' (the backend worker, once the task has its usage): the charge the task
--   recorded (its job's tpm field, written by submit.lua) less what it used goes back
--   (negative when it used more), once.
--   ARGV[1]: {op, id, used}. Returns the tokens given back.
local o = cjson.decode(ARGV[1])
local now = now_ms()

local function level(key)
  local f = redis.call('HMGET', key, 'tokens', 'at_ms', 'cap')
  local cap = tonumber(f[3]) or tonumber(o.tpm) or 0
  local tokens = tonumber(f[1]) or cap
  local at = tonumber(f[2]) or now
  if cap > 0 then tokens = math.min(cap, tokens + math.max(now - at, 0) * cap / 60000) end
  return tokens, cap
end

local function save(key, tokens, cap)
  redis.call('HSET', key, 'tokens', tokens, 'at_ms', now, 'cap', cap)
  -- Kept while it refills: a full bucket is the same as none.
  local ms = cap > 0 and math.ceil(math.max(cap - tokens, 0) / cap * 60000) or 0
  redis.call('PEXPIRE', key, ms + 60000)
end

if o.op == 'take' then
  local key = K.tpm(o.tenant)
  local tokens, cap = level(key)
  cap = tonumber(o.tpm)
  if tokens >= o.n or tokens >= cap then
    save(key, tokens - o.n, cap)
    return {1, math.floor(tokens - o.n)}
  end
  return {0, math.ceil((math.min(o.n, cap) - tokens) / cap * 60000)}
end

if o.op == 'give' then
  local key = K.tpm(o.tenant)
  local tokens, cap = level(key)
  save(key, math.min(cap, tokens + o.n), cap)
  return 1
end

-- settle
local jk = K.job(o.id)
local f = redis.call('HMGET', jk, 'tenant', 'tpm')
local charged = tonumber(f[2])
if not f[1] or not charged then return 0 end
redis.call('HDEL', jk, 'tpm')
local key = K.tpm(f[1])
if redis.call('EXISTS', key) == 0 then return 0 end -- refilled whole meanwhile
local tokens, cap = level(key)
local back = charged - (tonumber(o.used) or 0)
save(key, math.min(cap, tokens + back), cap)
return back
