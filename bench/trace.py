"""The balancing trace and zero-overhead models of the three dispatch policies.

:func:`make_trace` draws one seeded trace: log-normal service times (heavy tail: mean
200 ms, median ~40 ms, p99 ~2.6 s with sigma 1.8, capped at 40 means (8 s at the
default mean); stratified so short
traces keep the tail) and Poisson
arrivals whose rate puts ``workers`` servers at the requested load. The service times
and the arrival pattern are drawn once; a load only rescales the gaps, so every load
and every system runs the very same tasks in the very same order.

The zero-overhead models that replay a trace are in :mod:`bench.hetero` (workers of
any speeds; :func:`bench.hetero.ideal`, :func:`bench.hetero.round_robin` and
:func:`bench.hetero.least_connections` on equal workers). They return :class:`Task`
rows, the same shape the measured systems produce, so one set of metrics covers
models and measurements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

SIGMA = 1.8
CAP_S = 8.0  # at the default 200 ms mean; scaled with the mean


@dataclass(frozen=True)
class Trace:
    arrivals: list[float]  # seconds from the start
    services: list[float]  # seconds
    workers: int
    load: float


@dataclass(frozen=True)
class Task:
    created: float  # seconds (measured: Redis clock, relative to the first arrival)
    started: float
    ended: float
    worker: int
    queue: int  # the worker whose own queue held it; -1: the shared queue


def make_trace(n: int, workers: int, load: float, mean_s: float = 0.2, seed: int = 7) -> Trace:
    rng = np.random.default_rng(seed)
    mu = math.log(mean_s) - SIGMA**2 / 2
    # Stratified: one draw per quantile (i + 0.5) / n, in seeded random order, so even a
    # 200-task trace has the distribution's mean and tail instead of a lucky sample.
    quantiles = (np.arange(n) + 0.5) / n
    z = np.array([NormalDist().inv_cdf(q) for q in quantiles])
    services = np.minimum(np.exp(mu + SIGMA * z), CAP_S * mean_s / 0.2)
    services = np.round(rng.permutation(services), 4)
    gaps = rng.exponential(1.0, n)
    rate = load * workers / float(services.mean())  # arrivals per second
    arrivals = np.cumsum(gaps / rate) - gaps[0] / rate
    return Trace(arrivals.tolist(), services.tolist(), workers, load)


@dataclass(frozen=True)
class Metrics:
    p50: float
    p95: float
    p99: float
    mean: float
    makespan: float
    idle_share: float  # of worker time: idle while another queue (or the shared one) held work


def metrics(tasks: list[Task], workers: int, step_s: float = 0.001) -> Metrics:
    latency = np.array([t.ended - t.created for t in tasks])
    t0 = min(t.created for t in tasks)
    t1 = max(t.ended for t in tasks)
    return Metrics(
        p50=float(np.percentile(latency, 50)),
        p95=float(np.percentile(latency, 95)),
        p99=float(np.percentile(latency, 99)),
        mean=float(latency.mean()),
        makespan=t1 - t0,
        idle_share=_idle_share(tasks, workers, t0, t1, step_s),
    )


def _steps(n: int, spans: list[tuple[float, float]], t0: float, step_s: float) -> np.ndarray:
    """How many of ``spans`` cover each time step."""
    diff = np.zeros(n + 1, dtype=np.int32)
    for a, b in spans:
        i, j = int((a - t0) / step_s), int((b - t0) / step_s)
        if j > i:
            diff[i] += 1
            diff[j] -= 1
    return np.cumsum(diff)[:n]


def _idle_share(tasks: list[Task], workers: int, t0: float, t1: float, step_s: float) -> float:
    n = max(int((t1 - t0) / step_s) + 1, 1)
    waiting_all = _steps(n, [(t.created, t.started) for t in tasks], t0, step_s)
    lost = 0
    for k in range(workers):
        busy = _steps(n, [(t.started, t.ended) for t in tasks if t.worker == k], t0, step_s)
        own = _steps(n, [(t.created, t.started) for t in tasks if t.queue == k], t0, step_s)
        lost += int(np.count_nonzero((busy == 0) & (waiting_all - own > 0)))
    return lost / (workers * n)
