"""Task types a worker can run, declared with ``@task("name")``.

A task is a plain function taking its validated arguments (a pydantic model) and a
:class:`TaskContext`, and returning something JSON-serializable::

    class ResizeArgs(BaseModel):
        width: int = Field(ge=1, le=8192)

    @task("image.resize", file="required")
    def resize(args: ResizeArgs, ctx: TaskContext) -> dict[str, Any]:
        ctx.progress(0.5, "decoding")
        ...

Workers publish each type's JSON Schema, so the API refuses bad arguments before they
are queued; the worker validates again with the model (the authority). Only types
registered here run; a job naming anything else is refused (invariant 3).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal, Protocol, get_type_hints

from pydantic import BaseModel, ConfigDict

__all__ = [
    "REGISTRY",
    "Registry",
    "TaskCanceled",
    "TaskContext",
    "TaskFailure",
    "TaskSpec",
    "TaskTimeout",
    "UploadedFile",
    "task",
]

_NAME = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)*$")
FileUse = Literal["none", "optional", "required"]


class TaskFailure(Exception):
    """Raise in a handler to fail the task with a code and a clear message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class TaskInterrupt(BaseException):
    """Raised inside a running handler to stop it."""


class TaskTimeout(TaskInterrupt):
    """The task ran past its timeout."""


class TaskCanceled(TaskInterrupt):
    """A client canceled the running task."""


@dataclass(frozen=True)
class UploadedFile:
    """The document sent with the task (multipart ``file`` part)."""

    name: str
    content_type: str
    data: bytes

    @property
    def size(self) -> int:
        return len(self.data)


class TaskContext(Protocol):
    """What a handler may know and do besides its arguments."""

    task_id: str
    task_type: str
    task_class: str
    attempt: int
    file: UploadedFile | None
    device: dict[str, Any]
    log: logging.LoggerAdapter[logging.Logger]

    def progress(self, fraction: float, message: str = "") -> None:
        """Report progress (0..1) and a short message; shown in ``GET /tasks/<id>``."""

    def cancelled(self) -> bool:
        """True once a cancel was requested; long loops should check it and return."""


class _NoArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")


Handler = Callable[[Any, TaskContext], Any]


@dataclass(frozen=True)
class TaskSpec:
    name: str
    handler: Handler
    args_model: type[BaseModel]
    description: str
    file: FileUse
    retries: int

    def catalog_entry(self) -> dict[str, Any]:
        """What the API needs to validate a submission, without importing the task."""
        return {
            "schema": self.args_model.model_json_schema(),
            "description": self.description,
            "file": self.file,
        }


def _args_model(handler: Handler) -> type[BaseModel]:
    params = list(inspect.signature(handler).parameters)
    if not params:
        raise TypeError(f"task handler {handler.__qualname__} must take (args, ctx)")
    hint = get_type_hints(handler).get(params[0])
    if hint is None or hint is BaseModel:
        return _NoArgs
    if not (inspect.isclass(hint) and issubclass(hint, BaseModel)):
        raise TypeError(f"the first parameter of {handler.__qualname__} must be a pydantic model")
    return hint


class Registry:
    """Task types by name."""

    def __init__(self) -> None:
        self._specs: dict[str, TaskSpec] = {}

    def task(
        self, name: str, *, file: FileUse = "none", retries: int = 0, description: str = ""
    ) -> Callable[[Handler], Handler]:
        """Register the decorated function as task type ``name``.

        ``file``: whether the task takes an uploaded document; ``retries``: how many
        times a handler exception runs it again (default none: the task fails).
        """
        if not _NAME.match(name) or len(name) > 64:
            raise ValueError(f"task name {name!r} must be dotted lowercase words")

        def register(handler: Handler) -> Handler:
            if name in self._specs and self._specs[name].handler is not handler:
                raise ValueError(f"task type {name!r} is registered twice")
            doc = description or inspect.cleandoc(handler.__doc__ or "").split("\n")[0]
            spec = TaskSpec(name, handler, _args_model(handler), doc, file, retries)
            spec.catalog_entry()  # a model without a JSON Schema fails here, not at start
            self._specs[name] = spec
            return handler

        return register

    def get(self, name: str) -> TaskSpec | None:
        return self._specs.get(name)

    def names(self) -> list[str]:
        return sorted(self._specs)

    def catalog(self) -> dict[str, dict[str, Any]]:
        return {name: spec.catalog_entry() for name, spec in self._specs.items()}


REGISTRY = Registry()
task = REGISTRY.task


def load_task_modules(modules: Iterable[str]) -> None:
    """Import the modules whose ``@task`` declarations fill :data:`REGISTRY`."""
    for module in modules:
        importlib.import_module(module)
