-- Append a generation's chunks to its stream (gpulane:stream:<id>), from the task's
-- current attempt only: a backend worker that lost its lease (the task runs again
-- elsewhere) must not write into the stream its client reads. Any API process reads
-- the stream (XREAD), so a client may be served by another replica than the one that
-- took its request.
-- ARGV[1]: {id, worker, attempt, ttl_ms}; ARGV[2], ARGV[3], ...: kind, data pairs
-- (kind: chunk | end | error; data: JSON).
-- Returns 1 (appended) or 0 (fenced: the run is not the task's current attempt).
local o = cjson.decode(ARGV[1])
local f = redis.call('HMGET', K.job(o.id), 'status', 'worker_name', 'attempts')
if not holds(f, o.worker, o.attempt) then return 0 end
local sk = K.stream(o.id)
for i = 2, #ARGV - 1, 2 do redis.call('XADD', sk, '*', 'k', ARGV[i], 'd', ARGV[i + 1]) end
redis.call('PEXPIRE', sk, o.ttl_ms)
return 1
