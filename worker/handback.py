"""Handing a claimed task back to its queue, for every path that does it: a clean
shutdown (at the head), a retry (at the tail), and a GPU fault, which counts as a lost
attempt because it may be the task's own doing and must not earn more tries than a
task that kills its worker."""

from __future__ import annotations

from typing import Any

from dispatcher.contract.jobs import ErrorCode
from dispatcher.contract.metrics import Recorder
from dispatcher.contract.reap import Reaped, record_reaped
from dispatcher.contract.scripts import ReleaseVerdict
from worker.broker import Broker
from worker.claims import Claimed

__all__ = ["hand_back"]


def hand_back(
    broker: Broker,
    recorder: Recorder,
    claimed: Claimed,
    task_type: str,
    *,
    at_head: bool,
    fault: dict[str, Any] | None = None,
    why: str,
) -> ReleaseVerdict:
    """Release ``claimed`` and count what became of it. With ``fault`` the release is a
    lost attempt (``fault`` is the error the task ends with once its budget is spent).
    Returns the release script's verdict (``released`` when it is queued again)."""
    verdict = broker.release(claimed, at_head=at_head, fault=fault)
    if verdict != "released":
        reason = ErrorCode.GPU_FAULT if fault is not None else ErrorCode.WORKER_LOST
        record_reaped(
            [Reaped(claimed.task_id, claimed.cls, task_type, verdict, claimed.items)],
            recorder,
            why,
            reason,
        )
    return verdict
