-- Keep final task records no longer than `ttl_s` from now: /v1/embeddings' records (its
-- chunks, or a backend's relayed answer), read once by the route that answered from them,
-- need not hold their vectors the whole `result_ttl_s` (a chunk of 64 is ~130 KB). A record
-- that is not final (no TTL yet) or is gone is left alone, and a shorter TTL is kept: this
-- only ever lets go sooner.
-- ARGV[1]: ttl_s (a bare number, as get.lua takes a bare id); ARGV[2..]: task ids.
-- Returns how many records it shortened.
local ttl = tonumber(ARGV[1])
local shortened = 0
for i = 2, #ARGV do
  local k = K.job(ARGV[i])
  if redis.call('TTL', k) > ttl then
    redis.call('EXPIRE', k, ttl)
    shortened = shortened + 1
  end
end
return shortened
