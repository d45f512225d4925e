"""Admission arithmetic: wait estimates, pressure levels and Retry-After values.

Pure functions of a class's state, shared by submit (which gets exact depth from the
admission script) and ``GET /queues`` (which reads a snapshot), so both speak alike.

* estimated wait = (tasks ahead + 1) x recent run time / live workers serving the class
  (the expected time until a new task has run);
* pressure = ``full`` when a submit would be refused now, ``high`` past half of a
  limit (depth against ``max_queued``, estimate against ``max_wait_s``), else ``ok``;
* Retry-After on ``queue_full`` = time for the queue to drain back under the limit at
  the pool's drain rate (live workers / run time), in whole seconds, at least 1.
"""

from __future__ import annotations

import math

from dispatcher.contract.settings import ClassConfig

__all__ = ["NO_WORKERS_RETRY_S", "estimate_s", "pressure", "retry_after_s"]

NO_WORKERS_RETRY_S = 5  # about one lease period: a restarting worker is back by then
_MAX_RETRY_S = 3600


def estimate_s(ahead: int, run_s: float, workers: int) -> float | None:
    """Expected seconds until a task with ``ahead`` tasks before it has run."""
    if workers <= 0:
        return None
    return (ahead + 1) * run_s / workers


def refused(depth: int, est: float | None, workers: int, cfg: ClassConfig) -> bool:
    if workers == 0 and cfg.reject_without_workers:
        return True
    return depth >= cfg.max_queued or (est is not None and est > cfg.max_wait_s)


def pressure(depth: int, run_s: float, workers: int, cfg: ClassConfig) -> str:
    """Pressure a new submit would meet, for a queue holding ``depth`` tasks."""
    est = estimate_s(depth, run_s, workers)
    if refused(depth, est, workers, cfg):
        return "full"
    load = depth / cfg.max_queued
    if est is not None:
        load = max(load, est / cfg.max_wait_s)
    return "high" if load >= 0.5 else "ok"


def retry_after_s(depth: int, run_s: float, workers: int, cfg: ClassConfig) -> int:
    """Seconds until a refused submit would be accepted, at the current drain rate."""
    if workers <= 0:
        return NO_WORKERS_RETRY_S
    # The deepest queue a new task is still accepted behind, by either limit.
    by_wait = math.floor(cfg.max_wait_s * workers / run_s) - 1
    allowed = min(cfg.max_queued - 1, by_wait)
    excess = depth - max(allowed, 0)
    drain_per_s = workers / run_s
    return int(min(max(math.ceil(excess / drain_per_s), 1), _MAX_RETRY_S))


def retry_after_wait_s(estimated_s: float, cfg: ClassConfig) -> int:
    """Seconds until a wait refused by ``max_wait_s`` (the estimate submit.lua refused,
    fair order and the cards that fit included) is back under it: the work ahead
    drains one second of the estimate per second."""
    return int(min(max(math.ceil(estimated_s - cfg.max_wait_s), 1), _MAX_RETRY_S))
