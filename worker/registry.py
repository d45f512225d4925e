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

Model tasks add two things (``worker/tasks/embed.py`` is the example)::

    @task("embed", model="sentence-transformers/all-MiniLM-L6-v2", load=load_model,
          batch=Batch(max_size=64, max_wait_ms=5))
    def embed(batch: list[EmbedArgs], ctxs: list[TaskContext]) -> list[Any]: ...

- ``load``: called once per process with the device (``"cuda"`` or ``"cpu"``) after the
  worker is pinned and before it takes a task; the worker is ``starting`` ("loading
  model") until every load returned. ``model`` is published in the catalog entry.
- ``batch``: the handler takes a list of validated args and one context per item and
  returns one result per item, in order; an item may be a :class:`TaskFailure` (that
  item alone fails).

Placement: ``gpu_memory_mb`` declares the GPU memory one call needs beyond the loaded
models (for a batched type, one batch's). A worker takes such a task only while its
card has that much free, and the API refuses it when no live worker's card could ever
hold it; a request may ask for another amount (``gpu_memory_mb`` in ``POST /tasks``).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, get_args, get_origin, get_type_hints

from pydantic import BaseModel, ConfigDict

__all__ = [
    "REGISTRY",
    "Batch",
    "ModelLoader",
    "Registry",
    "Split",
    "TaskCanceled",
    "TaskContext",
    "TaskFailure",
    "TaskModuleError",
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


@dataclass(frozen=True)
class Split:
    """What :meth:`TaskContext.map` makes and the handler returns: its task runs on as
    ``count`` parts, tasks of ``task_type`` anywhere in the pool (``docs/design.md`` §4,
    "Tasks that split into parts"). Its result, once every part succeeded, is
    ``result`` plus, under ``into``, the parts' entries in order."""

    task_type: str
    count: int
    into: str
    flatten: bool
    result: dict[str, Any]
    first: int
    labels: tuple[str, ...] | None
    file: bool  # the parts read the task's upload
    gpu_memory_mb: int
    calls: tuple[bytes, ...] = field(repr=False)  # each part's call, encoded


class TaskContext(Protocol):
    """What a handler may know and do besides its arguments."""

    task_id: str
    task_type: str
    task_class: str
    attempt: int
    file: UploadedFile | None
    device: dict[str, Any]
    log: logging.LoggerAdapter[logging.Logger]
    parent: str | None  # a part's: the id of the task it is part of; else None
    part: int | None  # a part's index among its parent's parts (0 first); else None
    # How the requester takes embedding vectors: "float" (a list of numbers, the
    # default) or "base64" (little-endian float32, dispatcher.contract.vectors.pack),
    # which /v1/embeddings asks for. A handler may ignore it: the route takes either.
    encoding_format: str

    def map(
        self,
        task_type: str,
        items: list[dict[str, Any]],
        *,
        into: str = "results",
        flatten: bool = False,
        result: dict[str, Any] | None = None,
        first: int = 1,
        labels: list[str] | None = None,
    ) -> Split:
        """Split this task into one part per item (its args for ``task_type``); return
        what this gives. Each part's result is one entry of the merged list
        ``result[into]`` or, with ``flatten``, holds a list at ``into`` whose entries
        are. ``first``: the number of the first entry (``GET /tasks/<id>/result?pages=``);
        ``labels``: each part's description. ValueError for what cannot split."""
        ...

    def workers(self) -> int:
        """Live workers serving this task's class (at least 1): for sizing parts."""
        ...

    def progress(self, fraction: float, message: str = "") -> None:
        """Report progress (0..1) and a short message; shown in ``GET /tasks/<id>``."""

    def cancelled(self) -> bool:
        """True once a cancel was requested; long loops should check it and return."""


class _NoArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")


Handler = Callable[[Any, Any], Any]
ModelLoader = Callable[[str], None]


@dataclass(frozen=True)
class Batch:
    """Dynamic batching policy of a type: up to ``max_size`` queued tasks per handler
    call, waiting at most ``max_wait_ms`` for more when fewer are queued."""

    max_size: int = 32
    max_wait_ms: float = 5.0
    # A field of each item's result (a whole number, such as its tokens) by which a
    # call's device time is shared among its items (fair share, usage); None, or a
    # result without it: equal shares.
    share_by: str | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.max_size <= 1024:
            raise ValueError("Batch.max_size must be 1..1024")
        if not 0 <= self.max_wait_ms <= 10_000:
            raise ValueError("Batch.max_wait_ms must be 0..10000")


@dataclass(frozen=True)
class TaskSpec:
    name: str
    handler: Handler
    args_model: type[BaseModel]
    description: str
    file: FileUse
    retries: int
    batch: Batch | None = None
    model: str | None = None
    load: ModelLoader | None = None
    gpu_memory_mb: int = 0

    def catalog_entry(self) -> dict[str, Any]:
        """What the API needs to validate a submission, without importing the task."""
        entry: dict[str, Any] = {
            "schema": self.args_model.model_json_schema(),
            "description": self.description,
            "file": self.file,
        }
        if self.model is not None:
            entry["model"] = self.model
        if self.gpu_memory_mb:
            entry["gpu_memory_mb"] = self.gpu_memory_mb
        if self.batch is not None:  # the API packs a request's items into chunks this big
            entry["batch_max_size"] = self.batch.max_size
        return entry


def _args_model(handler: Handler, batched: bool) -> type[BaseModel]:
    params = list(inspect.signature(handler).parameters)
    if not params:
        raise TypeError(f"task handler {handler.__qualname__} must take (args, ctx)")
    hint = get_type_hints(handler).get(params[0])
    if batched:  # list[Args]
        inner = get_args(hint)
        if get_origin(hint) is not list or len(inner) != 1:
            raise TypeError(f"batched handler {handler.__qualname__} must take list[Args] first")
        hint = inner[0]
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
        self,
        name: str,
        *,
        file: FileUse = "none",
        retries: int = 0,
        description: str = "",
        batch: Batch | None = None,
        model: str | None = None,
        load: ModelLoader | None = None,
        gpu_memory_mb: int = 0,
    ) -> Callable[[Handler], Handler]:
        """Register the decorated function as task type ``name``.

        ``file``: whether the task takes an uploaded document; ``retries``: how many
        times a handler exception runs it again (default none: the task fails);
        ``batch``: a batched handler (module docstring); ``model``: the model id it
        serves (published in the catalog); ``load``: loads it once per process;
        ``gpu_memory_mb``: GPU memory a call needs (placement, module docstring).
        """
        if not _NAME.match(name) or len(name) > 64:
            raise ValueError(f"task name {name!r} must be dotted lowercase words")
        if isinstance(gpu_memory_mb, bool) or not isinstance(gpu_memory_mb, int):
            raise TypeError(f"gpu_memory_mb of {name!r} must be a whole number of MB")
        if gpu_memory_mb < 0:
            raise ValueError(f"gpu_memory_mb of {name!r} must be 0 or more")

        def register(handler: Handler) -> Handler:
            if name in self._specs and self._specs[name].handler is not handler:
                raise ValueError(f"task type {name!r} is registered twice")
            doc = description or inspect.cleandoc(handler.__doc__ or "").split("\n")[0]
            if batch is not None and file != "none":
                raise ValueError(f"batched task type {name!r} cannot take files")
            args_model = _args_model(handler, batch is not None)
            spec = TaskSpec(
                name, handler, args_model, doc, file, retries, batch, model, load, gpu_memory_mb
            )
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

    def loaders(self) -> dict[str, ModelLoader]:
        """Model loaders to run at start, by model id (the type's name if it has none);
        one loader shared by several types runs once."""
        out: dict[str, ModelLoader] = {}
        for spec in self._specs.values():
            if spec.load is not None and spec.load not in out.values():
                out[spec.model or spec.name] = spec.load
        return out


REGISTRY = Registry()
task = REGISTRY.task


class TaskModuleError(Exception):
    """A task module could not be imported (missing, or failing at import): a
    configuration mistake. The message is one line naming the module and the error."""


def load_task_modules(modules: Iterable[str]) -> None:
    """Import the modules whose ``@task`` declarations fill :data:`REGISTRY`;
    :class:`TaskModuleError` for the first that cannot be imported."""
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:  # any import-time error: the module is unusable as given
            # One line: the caller prints it as is (a multi-line message is folded).
            why = " ".join(str(exc).split())
            raise TaskModuleError(
                f"task module {module!r} cannot be imported: {type(exc).__name__}: {why}"
            ) from exc
