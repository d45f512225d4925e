"""The one function every gpulane job calls (:data:`dispatcher.contract.jobs.ENTRY_POINT`).

Jobs never name the code to run: they call ``worker.entry.run`` with a task type, and
:func:`run` runs only types in the worker's registry (invariant 3).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from worker.registry import REGISTRY, Registry, TaskContext, TaskFailure

__all__ = ["run"]


def run(
    task_type: str,
    args: dict[str, Any],
    file: dict[str, Any] | None = None,
    *,
    ctx: TaskContext,
    registry: Registry = REGISTRY,
) -> Any:
    """Validate ``args`` with the type's model and call its handler.

    ``file`` is the upload's description as stored in the job; its bytes are in
    ``ctx.file``. Raises :class:`TaskFailure` for an unknown type or invalid arguments.
    """
    spec = registry.get(task_type)
    if spec is None:
        raise TaskFailure(
            "unknown_task_type",
            f"This worker does not run task type {task_type!r}; it runs {registry.names()}.",
        )
    if spec.file == "required" and ctx.file is None:
        raise TaskFailure("invalid_args", f"Task type {task_type!r} needs an uploaded file.")
    try:
        model = spec.args_model.model_validate(args)
    except ValidationError as exc:
        raise TaskFailure("invalid_args", f"Invalid arguments for {task_type!r}: {exc}") from exc
    return spec.handler(model, ctx)
