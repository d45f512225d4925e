"""The entry tag every gpulane job names: ``gpulane.run``.

Jobs never name the code to run: they name this tag with a task type as data, and a
gpulane worker decodes that call itself and runs only types in its registry
(invariant 3; :class:`worker.batching.BatchRunner`, the one run path). The tag is a
name of its own, not a module path of the dispatcher or the worker, so moving or
renaming their packages never touches stored jobs. It is kept importable so the jobs
stay RQ jobs (``rq info``, rq-dashboard and KEDA read them) and a plain ``rq worker``
that takes one and calls it gets a clear failure instead of a task run without its
worker's checks, leases and device.
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
