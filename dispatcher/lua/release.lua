-- A live worker gives its task back: at the head of its queue when shutting down past
-- the grace period, at the tail to retry it after a handler error its type allows to
-- retry. Neither counts as a lost attempt.
-- ARGV[1]: {id, worker, class, classes, at_head}. Returns 'released' or what it found.
local o = cjson.decode(ARGV[1])
if redis.call('LREM', K.inflight(o.worker, o.class), 0, o.id) == 0 then return 'gone' end
local status = redis.call('HGET', K.job(o.id), 'status')
if status ~= 'started' then return status or 'gone' end
requeue(o.id, o.class, o.classes, {}, o.at_head)
return 'released'
