"""The function every gpulane job names (:data:`dispatcher.contract.jobs.ENTRY_POINT`).

Jobs never name the code to run: they name ``worker.entry.run`` with a task type as
data, and a gpulane worker decodes that call itself and runs only types in its
registry (invariant 3; :class:`worker.batching.BatchRunner`, the one run path). The
name is kept so the jobs stay RQ jobs (``rq info``, rq-dashboard and KEDA read them);
a plain ``rq worker`` that takes one and calls this function gets a clear failure
instead of a task run without its worker's checks, leases and device.
"""

from __future__ import annotations

from typing import Any

__all__ = ["run"]


def run(task_type: str, args: dict[str, Any], **_: Any) -> Any:
    """Refuse: gpulane tasks run in gpulane workers (``gpulane worker``)."""
    raise RuntimeError(
        f"gpulane task {task_type!r} must run in a gpulane worker (gpulane worker), "
        "not in a plain RQ worker"
    )
