"""gpulane benchmarks (issue 7): ``python -m bench [SCENARIO ...] [--smoke|--quick]``.

Scenarios, each in :mod:`bench.scenarios`:

- ``overhead``: no-op tasks through the whole path against plain RQ (latency,
  throughput, Redis commands per task);
- ``balancing``: a heavy-tailed trace through gpulane (pull), round-robin and
  least-connections push routers, and the ideal central queue (simulated);
- ``mixed``: the same trace on 2 fast and 2 half-speed workers: pull against
  round-robin, least-connections and lowest-latency push, measured and modelled;
- ``scaling``: throughput on 1, 2, 4 and 8 workers;
- ``api``: accepted HTTP submits per second and their latency under concurrency;
- ``memory``: resident memory of an idle worker and of the API after load;
- ``priority``: interactive waits under a batch flood, shared pool or one reserved worker;
- ``recovery``: SIGKILL of a busy worker until its task runs again, against plain RQ;
- ``latency``: when a client sees a 20 ms task's result (``Prefer: wait``, long-poll,
  SSE, 0.5 s polling) against its run time, and API memory and Redis connections
  with 1,000 concurrent long-polls.

Every scenario starts its own ``redis-server`` and real ``gpulane`` processes and
writes a markdown table and PNG charts to ``bench/results/``. Benchmarks are never
part of ``make test``; ``tests/test_bench_smoke.py`` runs each at ``--smoke`` size.
"""
