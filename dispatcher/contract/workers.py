"""The worker record format: the states a worker publishes in its
``gpulane:worker:<name>`` hash (``worker.state`` writes them; the API's pool read
model, the exporter and ``gpulane status`` read them), and the same worker as RQ's
worker registry shows it."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal, get_args

__all__ = [
    "NOT_SERVING",
    "RQ_STATE",
    "WORKER_STATES",
    "RqCurrent",
    "WorkerStatus",
    "rq_worker_view",
]

# What a worker publishes as its state (worker.state writes it, this module reads it).
WorkerStatus = Literal[
    "starting", "waiting_for_gpu", "idle", "busy", "backend_down", "stopping", "unhealthy"
]
WORKER_STATES: tuple[str, ...] = get_args(WorkerStatus)

# Live workers that take no task yet or any more: loading (registered before it has a
# device and its task modules), waiting for a free GPU, a backend worker whose server
# does not answer, draining on its way out, or out of service after a GPU fault.
# Admission must not count them as capacity.
NOT_SERVING = frozenset({"starting", "waiting_for_gpu", "backend_down", "stopping", "unhealthy"})


# RQ's worker registry (keys in dispatcher.contract.keys). Each worker publishes itself
# there in RQ 3's format so ``rq info``, rq-dashboard and ``rq.Worker.all`` list the
# pool. ``idle`` and ``busy`` are RQ's own states; ``starting`` is RQ's ``started``; the
# others (``waiting_for_gpu``, ``stopping``, ``unhealthy``) are written as they are: RQ
# stores the state as free text and its tools print it as is.
RQ_STATE: dict[str, str] = {"starting": "started"}


@dataclass(frozen=True)
class RqCurrent:
    """The task a worker runs, as RQ's execution of a job (id = the attempt number)."""

    task_id: str
    attempt: int
    started_ms: int


def rq_worker_view(
    info: dict[str, str],
    queues: list[str],
    current: RqCurrent | None,
    ip_address: str,
    version: str,
) -> dict[str, Any]:
    """What register/heartbeat write into RQ's registry for a worker whose gpulane hash
    fields are ``info``: ``fields`` (the ``rq:worker:<name>`` hash, ``last_heartbeat``
    added by the script from Redis' clock), ``queues`` (RQ's queue names = classes) and
    ``execution`` (the running task, or null)."""
    state = info["state"]
    fields = {
        "birth": _rq_time(int(info["started_ms"])),
        "queues": ",".join(queues),
        "state": RQ_STATE.get(state, state),
        "pid": info["pid"],
        "hostname": info["host"],
        "ip_address": ip_address,
        "version": version,
        "python_version": sys.version,
        "successful_job_count": info["tasks_done"],
        "failed_job_count": info["tasks_failed"],
        # RQ 1.x's field; RQ 2 and 3 read the running job from the executions below.
        "current_job": current.task_id if current else "",
    }
    execution = None
    if current is not None:
        execution = {
            "job_id": current.task_id,
            "id": str(current.attempt),
            "created_at": current.started_ms / 1000,
        }
    return {"fields": fields, "queues": queues, "execution": execution}


def _rq_time(ms: int) -> str:
    """RQ's timestamp format (``utcformat``): 2026-12-02T17:08:53.123000Z."""
    return datetime.fromtimestamp(ms / 1000, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
