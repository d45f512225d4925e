"""gpulane workers: device pinning, the task loop, leases and the task registry.

Task authors need only this::

    from worker import TaskContext, TaskFailure, task
"""

from worker.registry import (
    Batch,
    Split,
    TaskCanceled,
    TaskContext,
    TaskFailure,
    TaskTimeout,
    UploadedFile,
    task,
)

__all__ = [
    "Batch",
    "Split",
    "TaskCanceled",
    "TaskContext",
    "TaskFailure",
    "TaskTimeout",
    "UploadedFile",
    "task",
]
