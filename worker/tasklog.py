"""The worker's task lines: one per task transition, a batch's in one line each way.

A task that runs alone logs ``task started`` and ``task <status>`` at INFO, each with
its worker, task id, class, type and elapsed time. A batch of many records (single
submits of a batched type, dynamically batched across clients) logs one ``batch ...
started`` and one ``batch ... ended`` line at INFO naming every task (``tasks``, ids
comma-separated) with the counts of each status; each record's own lines go at DEBUG,
except a record that did not succeed, whose ``task <status>`` line stays at INFO. The
two lines per record cost 4.3 ms of the worker's thread a batch of 64 records, twice
the GPU proxy's forward pass (``bench batched``, with and without them).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from dispatcher.contract.jobs import TaskStatus
from worker.claims import Claimed

__all__ = ["Ended", "batch_started", "ended"]

log = logging.getLogger("gpulane.worker")


@dataclass(frozen=True)
class Ended:
    """One reported run, as its line tells it."""

    claimed: Claimed
    task_type: str
    status: str  # the public status (succeeded, failed, ...)
    run_s: float
    error: str | None = None  # the error code, if any


def _level(records: int) -> int:
    """A record's own line: INFO alone, DEBUG inside a batch of many."""
    return logging.INFO if records == 1 else logging.DEBUG


def batch_started(worker: str, claims: Sequence[Claimed], task_type: str, batched: bool) -> None:
    """The lines of a claim about to run: each record's ``task started``, and the
    batch's own line for a batched type."""
    level = _level(len(claims))
    if log.isEnabledFor(level):
        for claimed in claims:
            log.log(
                level,
                "task started",
                extra={
                    "worker": worker,
                    "task": claimed.task_id,
                    "class": claimed.cls,
                    "attempt": claimed.attempt,
                },
            )
    if batched or len(claims) > 1:  # several records: the line that names them at INFO
        extra = {"worker": worker, "class": claims[0].cls, "type": task_type}
        if len(claims) > 1:
            extra["tasks"] = ",".join(c.task_id for c in claims)
        log.info(
            "batch of %d items (%d records) started",
            sum(c.items for c in claims),
            len(claims),
            extra=extra,
        )


def ended(worker: str, runs: Sequence[Ended]) -> None:
    """The lines of reported runs: each one's ``task <status>`` (INFO alone or when it
    did not succeed), and for many records one ``batch ... ended`` line."""
    level = _level(len(runs))
    for run in runs:
        own = logging.INFO if run.status != TaskStatus.SUCCEEDED else level
        if log.isEnabledFor(own):
            log.log(
                own,
                "task %s",
                run.status,
                extra={
                    "worker": worker,
                    "task": run.claimed.task_id,
                    "class": run.claimed.cls,
                    "type": run.task_type,
                    "elapsed_s": round(run.run_s, 3),
                    **({"error": run.error} if run.error else {}),
                },
            )
    if len(runs) > 1:
        counts = Counter(run.status for run in runs)
        log.info(
            "batch of %d records ended: %s",
            len(runs),
            ", ".join(f"{n} {status}" for status, n in sorted(counts.items())),
            extra={
                "worker": worker,
                "class": runs[0].claimed.cls,
                "type": runs[0].claimed.task_type or runs[0].task_type,  # claim.lua gives it
                "tasks": ",".join(run.claimed.task_id for run in runs),
                "elapsed_s": round(max(run.run_s for run in runs), 3),
            },
        )
