"""Splitting a running task into parts: what ``ctx.map`` checks and makes.

A handler returns ``ctx.map(type, items, ...)``; the worker reports the
:class:`~worker.registry.Split` with ``split.lua`` (one atomic step: the parts are
queued at the head of the task's class, and the task waits for them without holding
this worker), and the parts run anywhere in the pool. Everything about a split that
can be wrong is found here, while the handler still runs, so its task fails with the
reason (``task_error``) instead of queueing parts that cannot run: an unknown or
batched part type, no items or too many, args the part type refuses, a part that
tries to split again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from dispatcher.contract.jobs import FileMeta, encode_call
from dispatcher.contract.parts import MAX_PARTS
from worker.registry import Registry, Split, UploadedFile

__all__ = ["Splitter"]

_NAME_MAX = 64  # the merged list's key: a JSON object key a client reads


class Splitter:
    """Makes the splits of one worker's tasks; ``pool_size(cls)`` counts the live
    workers serving a class (for handlers sizing their parts)."""

    def __init__(self, registry: Registry, pool_size: Callable[[str], int]) -> None:
        self.registry = registry
        self._pool_size = pool_size

    def workers(self, cls: str) -> int:
        try:
            return max(1, self._pool_size(cls))
        except Exception:  # noqa: BLE001 - sizing only: a Redis hiccup must not fail the task
            return 1

    def split(
        self,
        parent: str | None,
        upload: UploadedFile | None,
        task_type: str,
        items: list[dict[str, Any]],
        *,
        into: str = "results",
        flatten: bool = False,
        result: dict[str, Any] | None = None,
        first: int = 1,
        labels: list[str] | None = None,
    ) -> Split:
        """The checked split of a task (``parent``: its own parent, which forbids it)."""
        if parent is not None:
            raise ValueError("a part cannot split again: split the task it is part of")
        spec = self.registry.get(task_type)
        if spec is None:
            raise ValueError(f"cannot split into {task_type!r}: no such task type here")
        if spec.batch is not None:
            raise ValueError(f"cannot split into {task_type!r}: a batched type takes no parts")
        if not 1 <= len(items) <= MAX_PARTS:
            raise ValueError(f"a task splits into 1 to {MAX_PARTS} parts, not {len(items)}")
        if not (isinstance(into, str) and 0 < len(into) <= _NAME_MAX):
            raise ValueError(f"into must be a key of 1 to {_NAME_MAX} characters")
        result = dict(result or {})
        if into in result:
            raise ValueError(f"result already has {into!r}, where the parts' entries go")
        if labels is not None and len(labels) != len(items):
            raise ValueError("labels, when given, name every part")
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise ValueError("first must be a whole number, 0 or more")
        meta = None
        if upload is not None and spec.file != "none":
            meta = FileMeta(upload.name, upload.content_type, upload.size)
        elif spec.file == "required":
            raise ValueError(f"{task_type!r} needs a file and this task has none")
        calls = []
        for index, raw in enumerate(items):
            try:
                args = spec.args_model.model_validate(raw).model_dump(mode="json")
            except ValidationError as exc:
                why = f"part {index}: invalid arguments for {task_type!r}: {exc}"
                raise ValueError(why) from exc
            calls.append(encode_call(task_type, args, meta))
        return Split(
            task_type=task_type,
            count=len(items),
            into=into,
            flatten=flatten,
            result=result,
            first=first,
            labels=tuple(str(label)[:200] for label in labels) if labels is not None else None,
            file=meta is not None,
            gpu_memory_mb=spec.gpu_memory_mb,  # as its type declares (a request's own ask
            # was for the task that split, which may need another amount)
            calls=tuple(calls),
        )
