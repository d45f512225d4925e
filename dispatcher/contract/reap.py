"""Giving back the tasks of dead workers (invariant 1).

Every worker renews a lease (its score in ``gpulane:workers``) each heartbeat. Any
process may run the reaper each heartbeat (the API and every worker do); reap.lua
takes a lock so one pass per period runs pool-wide. A pass finds workers whose lease
expired, puts each task they held back at the head of its queue with one more lost
attempt, or fails it with ``worker_lost`` once ``max_attempts`` are spent.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from dispatcher.contract.jobs import ErrorCode
from dispatcher.contract.metrics import Recorder
from dispatcher.contract.scripts import options
from dispatcher.contract.settings import Settings

__all__ = ["Reaped", "lease_options", "parse_reaped", "reap_options", "record_reaped"]

log = logging.getLogger("gpulane.reaper")


@dataclass(frozen=True)
class Reaped:
    task_id: str
    cls: str
    task_type: str
    outcome: str  # requeued | failed | canceled | gone
    items: int = 1  # a chunk's items: what the metrics count


def lease_options(settings: Settings) -> dict[str, Any]:
    """What every script that may give tasks back needs to know."""
    return {
        "ttl_ms": int(settings.lease_ttl_s * 1000),
        "ttl_s": settings.result_ttl_s,
        "max_attempts": settings.max_attempts,
        "classes": settings.class_names,
    }


def reap_options(settings: Settings) -> str:
    # The lock lives a little under one heartbeat so that one of the many callers per
    # period gets through, and the pass after it is at most one period later.
    lock_ms = max(int(settings.heartbeat_interval_s * 900), 50)
    return options(**lease_options(settings), lock_ms=lock_ms, limit=64)


def parse_reaped(lines: list[Any]) -> list[Reaped]:
    out = []
    for line in lines:
        text = line.decode() if isinstance(line, bytes) else str(line)
        task_id, cls, task_type, outcome, items = text.rsplit("|", 4)
        out.append(Reaped(task_id, cls, task_type, outcome, int(items)))
    return out


def record_reaped(
    reaped: list[Reaped], recorder: Recorder, why: str, reason: str = ErrorCode.WORKER_LOST
) -> None:
    """Count and log tasks given back without a worker reporting them: by a reaper pass,
    or by a worker handing its task back. A requeued task counts in
    ``requeued_total{reason}``; one that ended there (``failed`` after its attempts,
    ``canceled``) in ``finished_total``, since no worker will report it.
    """
    for item in reaped:
        if item.outcome == "requeued":
            recorder.count("requeued", item.cls, reason, n=item.items)
        elif item.outcome in ("failed", "canceled"):
            recorder.count("finished", item.cls, item.task_type, item.outcome, n=item.items)
        log.warning(
            "%s: %s",
            why,
            item.outcome,
            extra={"task": item.task_id, "class": item.cls, "type": item.task_type},
        )
