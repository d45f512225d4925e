"""The read side of admission: a class's wait estimate and pressure as ``GET /queues``
(and the headers of routes that have not submitted yet) show them, from the pool
snapshot, with no request in hand.

A submit's own answer is decided by submit.lua, once, from the counts that admitted
or refused it (its fair-order position, the workers whose card fits the task): the
estimate, the pressure the next submit meets and a refusal's Retry-After
(``SubmitResult``). The rules here are the same, for a one-item task of the class:

* estimated wait = (tasks ahead + 1) x recent run time / live workers serving the class
  (the expected time until a new task has run);
* pressure = ``full`` when a submit would be refused now, ``high`` past half of a
  limit (depth against ``max_queued``, estimate against ``max_wait_s``), else ``ok``.
"""

from __future__ import annotations

from dispatcher.contract.settings import ClassConfig

__all__ = ["estimate_s", "pressure", "refused"]


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
