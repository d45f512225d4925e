"""Zero-overhead models of dispatch policies on workers of unequal speed.

Worker ``k`` runs a task of size ``s`` (seconds on a full-speed worker) in
``s * slowdown[k]`` seconds. Every model replays a :class:`bench.trace.Trace` (the
same seeded heavy-tailed trace as ``balancing``) and returns :class:`bench.trace.Task`
rows, the shape the measured systems produce, so one set of metrics covers both.

- :func:`central`: one FCFS queue. When the task at its head can start, it goes to a
  free worker; ``pick`` chooses among the free ones. ``fastest`` (the fastest free
  worker, then the lowest index) is the ideal central queue; ``doorbell`` is how
  gpulane's doorbell picks among parked workers that declared their speeds (``ZPOPMIN``
  of the class's idle set: the lowest rank ``round(1000 / speed)``, then, free GPU
  memory being equal, the name); ``random_pick`` is a speed-blind doorbell (any parked
  worker: gpulane's before workers declared speeds, ``SPOP`` of a set);
  ``earliest_free`` (the worker free longest) is :func:`ideal`, the
  equal-worker ideal. A task that waited starts on the first worker to free up, in all.
- :func:`push`: each task joins one worker's own queue when it arrives, served FCFS by
  that worker. Routers: ``"rr"`` round-robin, ``"lc"`` least connections (fewest
  outstanding tasks, queued + running, ties round-robin), ``"ll"`` lowest latency (the
  lowest EWMA of end-to-end latency over the worker's completed tasks, as the router
  observes them end; a worker with none yet counts 0 and is tried first; ties
  round-robin), the "lowest latency" routing of model gateways; ``"le"`` latency x
  load (model only): the lowest EWMA x (outstanding + 1), the load-aware variant of
  Finagle's and Linkerd's peak-EWMA balancers, for comparison.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bench.trace import Task, Trace

EWMA_ALPHA = 0.3  # weight of the newest completed task in the lowest-latency router

# Chooses among the free workers (by index), given when each worker frees up.
Pick = Callable[[list[int], Sequence[float]], int]


def fastest(slowdown: Sequence[float]) -> Pick:
    """The fastest free worker, then the lowest index."""
    return lambda free, _: min(free, key=lambda k: (slowdown[k], k))


def earliest_free(free: list[int], free_at: Sequence[float]) -> int:
    """The worker free longest, then the lowest index: the order of a heap of free
    servers, :func:`ideal`'s pick on equal workers."""
    return min(free, key=lambda k: (free_at[k], k))


def doorbell(slowdown: Sequence[float], names: Sequence[str]) -> Pick:
    """gpulane's doorbell when each worker declares ``worker_speed`` = 1 / its slowdown
    and all have the same GPU memory free (or none: the cpu): ``ZPOPMIN`` of the idle
    set, scored ``round(1000 / speed) x 2^32 + free MB``; equal scores go by name."""
    rank = [round(1000 / (1 / s)) for s in slowdown]
    return lambda free, _: min(free, key=lambda k: (rank[k], names[k]))


def random_pick(seed: int) -> Pick:
    """Any free worker, uniformly: a doorbell blind to speed (gpulane's before worker
    speeds: ``SPOP`` of the idle set)."""
    rng = random.Random(seed)
    return lambda free, _: free[rng.randrange(len(free))]


def central(trace: Trace, slowdown: Sequence[float], pick: Pick) -> list[Task]:
    """One FCFS queue; the head task starts on a free worker chosen by ``pick``."""
    free_at = [0.0] * len(slowdown)
    out = []
    for arrival, size in zip(trace.arrivals, trace.services, strict=True):
        start = max(arrival, min(free_at))
        k = pick([j for j, at in enumerate(free_at) if at <= start], free_at)
        end = start + size * slowdown[k]
        free_at[k] = end
        out.append(Task(arrival, start, end, k, -1))
    return out


class Router:
    """A push router's choice for each arriving task, from what it has observed."""

    def __init__(self, policy: str, workers: int) -> None:
        if policy not in ("rr", "lc", "ll", "le"):
            raise ValueError(f"unknown router {policy!r}")
        self.policy = policy
        self.workers = workers
        self.pointer = 0
        self.ewma: list[float | None] = [None] * workers

    def observe(self, k: int, latency_s: float) -> None:
        """A task routed to worker ``k`` ended after ``latency_s`` end to end."""
        old = self.ewma[k]
        self.ewma[k] = latency_s if old is None else EWMA_ALPHA * latency_s + (1 - EWMA_ALPHA) * old

    def choose(self, outstanding: Sequence[int] | None = None) -> int:
        """The worker for the task arriving now (``outstanding``: per worker, for lc, le)."""
        order = [(self.pointer + j) % self.workers for j in range(self.workers)]
        if self.policy == "rr":
            k = order[0]
        elif self.policy == "lc":
            if outstanding is None:
                raise ValueError("least connections needs the outstanding counts")
            k = min(order, key=lambda j: outstanding[j])
        elif self.policy == "le":
            if outstanding is None:
                raise ValueError("latency x load needs the outstanding counts")
            k = min(order, key=lambda j: (self.ewma[j] or 0.0) * (outstanding[j] + 1))
        else:
            k = min(order, key=lambda j: self.ewma[j] or 0.0)
        self.pointer = (k + 1) % self.workers
        return k


def push(trace: Trace, slowdown: Sequence[float], policy: str) -> list[Task]:
    """Each task goes to the queue of the worker the router picks when it arrives."""
    workers = len(slowdown)
    router = Router(policy, workers)
    free_at = [0.0] * workers
    running: list[tuple[float, int, float]] = []  # (end, worker, latency): not yet observed
    outstanding = [0] * workers
    out = []
    for arrival, size in zip(trace.arrivals, trace.services, strict=True):
        while running and running[0][0] <= arrival:
            _, j, latency = heapq.heappop(running)
            outstanding[j] -= 1
            router.observe(j, latency)
        k = router.choose(outstanding)
        start = max(arrival, free_at[k])
        end = start + size * slowdown[k]
        free_at[k] = end
        outstanding[k] += 1
        heapq.heappush(running, (end, k, end - arrival))
        out.append(Task(arrival, start, end, k, k))
    return out


@dataclass(frozen=True)
class Spread:
    """p99 / ideal p99 of the random-doorbell model over many seeds."""

    seeds: int
    median: float
    p10: float
    p90: float
    within_2pct: float  # share of seeds with p99 <= 1.02 x ideal
    p50_median: float  # p50 / ideal p50, median over the seeds
    wait_median: float  # mean wait in the queue (s), median over the seeds
    tail_wait_median: float  # mean wait of the slowest 1 % of tasks (s), median over the seeds


def _equal(trace: Trace) -> list[float]:
    """Slowdowns of ``trace.workers`` equal workers (balancing's pool)."""
    return [1.0] * trace.workers


def ideal(trace: Trace) -> list[Task]:
    """Ideal central queue on equal workers: FCFS, a free server takes the next task at
    once (the one free longest, then the lowest index)."""
    return central(trace, _equal(trace), earliest_free)


def round_robin(trace: Trace) -> list[Task]:
    """Equal workers, task i joins worker i mod k's own queue."""
    return push(trace, _equal(trace), "rr")


def least_connections(trace: Trace) -> list[Task]:
    """Equal workers, each task joins the queue of the worker with the fewest
    outstanding tasks, ties round-robin."""
    return push(trace, _equal(trace), "lc")


def waits(tasks: list[Task]) -> tuple[float, float]:
    """Mean wait before starting (s), over all tasks and over the 1 % of highest latency."""
    ranked = sorted(tasks, key=lambda t: t.ended - t.created)
    tail = ranked[-max(1, len(tasks) // 100) :]
    mean = sum(t.started - t.created for t in tasks) / len(tasks)
    return mean, sum(t.started - t.created for t in tail) / len(tail)


def random_spread(trace: Trace, slowdown: Sequence[float], seeds: int) -> Spread:
    """p99 (and p50) of the random-doorbell model over ``seeds`` seeds, each over the
    ideal central queue's (fastest free first) on the same trace."""
    import numpy as np

    def pcts(tasks: list[Task]) -> tuple[float, float, float, float]:
        latency = np.array([t.ended - t.created for t in tasks])
        p50, p99 = float(np.percentile(latency, 50)), float(np.percentile(latency, 99))
        return (p50, p99, *waits(tasks))

    ideal50, ideal99, _, _ = pcts(central(trace, slowdown, fastest(slowdown)))
    runs = np.array([pcts(central(trace, slowdown, random_pick(seed))) for seed in range(seeds)])
    p99 = runs[:, 1] / ideal99
    return Spread(
        seeds=seeds,
        median=float(np.median(p99)),
        p10=float(np.percentile(p99, 10)),
        p90=float(np.percentile(p99, 90)),
        within_2pct=float(np.mean(p99 <= 1.02)),
        p50_median=float(np.median(runs[:, 0] / ideal50)),
        wait_median=float(np.median(runs[:, 2])),
        tail_wait_median=float(np.median(runs[:, 3])),
    )
