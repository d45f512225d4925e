-- The reaper: forget a dead worker and give back what it held.

-- Forget worker `w` and give back what it held. Returns {"id|class|type|outcome|items", ...}.
local function reap_worker(w, now, o)
  local out = {}
  -- A backend worker parks in its types' idle sets (`parks`: their names, JSON).
  local parks = redis.call('HGET', K.worker(w), 'parks')
  parks = parks and parks ~= '' and cjson.decode(parks) or {}
  for _, c in ipairs(o.classes) do
    local ik = K.inflight(w, c)
    local held = redis.call('LRANGE', ik, 0, -1)
    for i = #held, 1, -1 do -- last first: a batch goes back to the head in its order
      local id = held[i]
      local outcome, task_type, items = lose(id, c, w, now, o)
      out[#out + 1] = id .. '|' .. c .. '|' .. task_type .. '|' .. outcome .. '|' .. items
    end
    redis.call('DEL', ik)
    redis.call('ZREM', K.parked(c), w)
    for _, t in ipairs(parks) do redis.call('ZREM', K.parked_type(c, t), w) end
  end
  redis.call('DEL', K.worker(w), K.wake(w), K.control(w))
  redis.call('ZREM', K.WORKERS, w)
  rq_forget(w, o.classes)
  return out
end
