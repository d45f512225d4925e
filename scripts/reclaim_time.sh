#!/bin/bash
# How long a SIGKILLed worker's GPU takes to be claimed by a waiting worker, with the
# default settings (lease_ttl_s 3, heartbeat_interval_s 1) and the fake pynvml (1 card).
# Usage: scripts/reclaim_time.sh [redis-port]   (starts its own redis-server there)
set -u
cd "$(dirname "$0")/.."
PORT=${1:-6392}
DIR=$(mktemp -d)
redis-server --port $PORT --save '' --daemonize yes --dir "$DIR" >/dev/null; sleep 0.3
export PYTHONPATH=tests/support/fake_nvml:.:tests/support GPULANE_FAKE_NVML=1 GPULANE_REDIS_URL=redis://127.0.0.1:$PORT/0
for run in 1 2 3; do
  .venv/bin/gpulane worker --name holder > "$DIR"/holder.log 2>&1 & H=$!
  until [ "$(redis-cli -p $PORT get gpulane:gpu:GPU-fa4e0000-0000-4000-8000-000000000000:0)" = holder ]; do sleep 0.05; done
  .venv/bin/gpulane worker --name waiter > "$DIR"/waiter.log 2>&1 & W=$!
  until [ "$(redis-cli -p $PORT hget gpulane:worker:waiter state)" = waiting_for_gpu ]; do sleep 0.05; done
  sleep "1.$((RANDOM % 10))"  # kill at varying points of the holder's 1 s renewal cycle
  T0=$(date +%s.%N); kill -9 $H; wait $H 2>/dev/null
  until [ "$(redis-cli -p $PORT get gpulane:gpu:GPU-fa4e0000-0000-4000-8000-000000000000:0)" = waiter ]; do sleep 0.02; done
  T1=$(date +%s.%N)
  until [ "$(redis-cli -p $PORT hget gpulane:worker:waiter state)" = idle ]; do sleep 0.02; done
  T2=$(date +%s.%N)
  echo "run $run: claimed $(echo "$T1 - $T0" | bc) s after SIGKILL, listed idle after $(echo "$T2 - $T0" | bc) s"
  kill $W; wait $W 2>/dev/null
  redis-cli -p $PORT flushall >/dev/null
done
redis-cli -p $PORT shutdown nosave
rm -rf "$DIR"
