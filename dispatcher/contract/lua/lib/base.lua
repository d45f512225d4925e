-- Redis-clock time, RQ's timestamps, the task-events channel, numbers as Redis reads them.

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- RQ's timestamp format (2026-12-02T17:08:53.123000Z), from epoch milliseconds.
local function iso(ms)
  local secs = math.floor(ms / 1000)
  local days = math.floor(secs / 86400)
  local rem = secs - days * 86400
  local z = days + 719468 -- days-to-civil, H. Hinnant
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524)
    - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local day = doy - math.floor((153 * mp + 2) / 5) + 1
  local month = mp < 10 and mp + 3 or mp - 9
  local year = yoe + era * 400 + (month <= 2 and 1 or 0)
  return string.format('%04d-%02d-%02dT%02d:%02d:%02d.%06dZ', year, month, day,
    math.floor(rem / 3600), math.floor(rem % 3600 / 60), rem % 60, (ms % 1000) * 1000)
end

-- Tell every API process that task `id` changed (status or progress): its waiters
-- re-read the record (long-polls, Prefer: wait, event streams). `kind` names a change
-- that cannot end the task ('<id> started', '<id> progress'): a wait for the end reads
-- nothing for it. A bare id may be an end (so is any message an older or newer
-- process does not know: it costs a read, never a missed end).
local function notify(id, kind)
  redis.call('PUBLISH', K.EVENTS, kind and (id .. ' ' .. kind) or id)
end

-- A number as Redis should read it: every digit of a whole number (Lua would send 14
-- significant digits, and tags and scores run past that).
local function num(x)
  return string.format('%.17g', x)
end
