-- A worker leaves, from gpulane's registry and RQ's. Anything still in its in-flight
-- lists is given back as lost (a clean exit has none: it finished or released its
-- task first).
-- ARGV[1]: {worker, ttl_s, max_attempts, classes}. Returns {"id|class|type|outcome|items", ...}.
local o = cjson.decode(ARGV[1])
return reap_worker(o.worker, now_ms(), o)
