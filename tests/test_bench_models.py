"""balancing's equal-worker models are mixed's (bench.hetero) at slowdown 1.

bench/trace.py's ``central``, ``round_robin`` and ``least_connections`` once had their
own implementations; they are now bench/hetero.py's ``ideal``, ``round_robin`` and
``least_connections`` on equal workers. The references below are those former
implementations, kept here as oracles: on fixed seeds and several loads, the
models must give the very same rows (start, end, worker and queue of every task), so
balancing's reports did not change with the refactor.
"""

from __future__ import annotations

import bisect
import heapq

import pytest

from bench import hetero
from bench import trace as tr

SEEDS = (7, 11, 23)
LOADS = (0.5, 0.7, 0.9, 1.1)
WORKERS = 4


def reference_central(trace: tr.Trace) -> list[tr.Task]:
    """The former trace.central: a heap of free servers, (free since, index)."""
    free = [(0.0, k) for k in range(trace.workers)]
    out = []
    for arrival, service in zip(trace.arrivals, trace.services, strict=True):
        at, k = heapq.heappop(free)
        start = max(at, arrival)
        out.append(tr.Task(arrival, start, start + service, k, -1))
        heapq.heappush(free, (start + service, k))
    return out


def reference_push(trace: tr.Trace, round_robin: bool) -> list[tr.Task]:
    """The former trace._push: round-robin, or least connections counted by bisection."""
    ends: list[list[float]] = [[] for _ in range(trace.workers)]
    out = []
    pointer = 0
    for i, (arrival, service) in enumerate(zip(trace.arrivals, trace.services, strict=True)):
        if round_robin:
            k = i % trace.workers
        else:
            outstanding = [len(e) - bisect.bisect_right(e, arrival) for e in ends]
            order = [(pointer + j) % trace.workers for j in range(trace.workers)]
            k = min(order, key=lambda j: outstanding[j])
            pointer = (k + 1) % trace.workers
        start = max(arrival, ends[k][-1] if ends[k] else 0.0)
        ends[k].append(start + service)
        out.append(tr.Task(arrival, start, start + service, k, k))
    return out


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("load", LOADS)
def test_equal_worker_models_are_hetero_at_slowdown_1(seed: int, load: float) -> None:
    trace = tr.make_trace(300, WORKERS, load, seed=seed)
    # (ideal, round_robin and least_connections are central/push at slowdown 1.)
    assert hetero.ideal(trace) == reference_central(trace)
    assert hetero.round_robin(trace) == reference_push(trace, round_robin=True)
    assert hetero.least_connections(trace) == reference_push(trace, round_robin=False)
