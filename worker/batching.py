"""The worker's one run path: claimed records in, one :class:`Outcome` per record out.

A single task is a batch of one: decoding and refusing a call, checking its args,
the timeout, cancels, interrupts and the GPU clean-up are written here once, for every
type. A type that is not batched runs its handler once per record (one args, one
context); a batched type runs the valid items of all the claimed records in one call.

A record is a task (one item) or a chunk (several items of one request travelling
together, ``docs/design.md`` §4). A batched type's handler takes a list of validated
args and one context per item (a chunk's items share its context) and returns one
result per item. Validation is per item (a bad item fails alone: a task's record
fails, a chunk's item gets its error in the chunk's result); cancel, timeout,
progress, attempts and the report are per record. An interrupt stops the whole call,
so the records it was not meant for run again in a new call:

- a cancel: the canceled item ends ``canceled``; the others run again;
- a timeout (the timer is armed for the earliest item deadline): the items past their
  own deadline end ``timeout``; the others run again with what time they have left;
- a hand-back (shutdown) or a GPU fault: every unfinished item is handed back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError

from dispatcher.contract.jobs import Call, CallRefused, ErrorCode, decode_call
from dispatcher.contract.settings import Settings
from worker.claims import Claimed
from worker.execute import (
    GpuFault,
    LeaseLost,
    Outcome,
    Runner,
    RunningTask,
    TaskHandback,
    canceled,
)
from worker.gpu.health import free_cached_memory
from worker.registry import (
    Batch,
    Registry,
    TaskCanceled,
    TaskSpec,
    TaskTimeout,
    UploadedFile,
)

__all__ = ["BatchRunner", "Item", "batch_policies"]


def batch_policies(registry: Registry, settings: Settings) -> dict[str, Batch]:
    """Every batched type's policy: its ``Batch``, overridden by ``[types.<name>]``."""
    out: dict[str, Batch] = {}
    for name in registry.names():
        spec = registry.get(name)
        if spec is None or spec.batch is None:
            continue
        override = settings.types.get(name)
        size, wait = spec.batch.max_size, spec.batch.max_wait_ms
        if override is not None:
            size = override.batch_max_size or size
            wait = wait if override.batch_max_wait_ms is None else override.batch_max_wait_ms
        out[name] = Batch(size, wait, spec.batch.share_by)
    return out


@dataclass
class Item:
    """One record of a batch (a task or a chunk) and, once known, how it ended.
    ``args``: each item's validated args, None for an item that failed validation (its
    error in ``errors``, by index in the chunk)."""

    claimed: Claimed
    ctx: RunningTask | None = None
    args: list[BaseModel | None] = field(default_factory=list)
    errors: dict[str, dict[str, str]] = field(default_factory=dict)
    outcome: Outcome | None = None
    chunk: bool = False
    device_s: float = 0.0  # its share of the handler calls it was in (fair share, usage)

    @property
    def valid(self) -> list[BaseModel]:
        return [a for a in self.args if a is not None]


class BatchRunner:
    """Runs claimed records (a task, or a batch) through :class:`Runner`'s interrupts,
    cancels and result encoding."""

    def __init__(self, runner: Runner, sizes: dict[str, int] | None = None) -> None:
        self.runner = runner
        # This worker's batch size per type ([types.<name>] overrides included): a
        # chunk packed for a bigger batch runs in calls of at most this many items.
        self.sizes = sizes or {}
        self._lists: dict[type[BaseModel], TypeAdapter[list[BaseModel]]] = {}

    def run(self, claims: list[Claimed]) -> list[Item]:
        items = [self._prepare(claimed) for claimed in claims]
        pending = [item for item in items if item.outcome is None]
        if pending:
            spec = self.runner.registry.get(pending[0].ctx.task_type)  # type: ignore[union-attr]
            assert spec is not None  # _prepare checked
            # A type that is not batched runs each record in a call of its own.
            groups = [pending] if spec.batch is not None else [[item] for item in pending]
            try:
                for group in groups:
                    self._run(spec, group)
            finally:
                self.runner.end_batch()
        if any(
            i.outcome and (i.outcome.error or {}).get("code") == ErrorCode.GPU_OUT_OF_MEMORY
            for i in items
        ):
            free_cached_memory()
        return items

    def _prepare(self, claimed: Claimed) -> Item:
        """Decode the record and check its args; ``outcome`` is set when it cannot run."""
        item = Item(claimed)
        runner = self.runner
        try:
            call = decode_call(claimed.data)
        except CallRefused as exc:
            item.outcome = Outcome.fail(ErrorCode.REFUSED, f"Refused: {exc}.")
            return item
        upload = None
        if call.file is not None and claimed.file is not None:
            upload = UploadedFile(call.file.name, call.file.content_type, claimed.file)
        item.ctx = RunningTask(
            claimed,
            call.task_type,
            upload,
            runner.device,
            runner.sink,
            runner.worker,
            runner.splitter,
        )
        spec = runner.registry.get(call.task_type)
        item.outcome = _unrunnable(spec, call, upload is not None, runner.registry)
        if item.outcome is not None or spec is None:
            return item
        if call.items is None:
            try:
                item.args = [spec.args_model.model_validate(call.args)]
            except ValidationError as exc:
                item.outcome = Outcome.fail(ErrorCode.INVALID_ARGS, _invalid(call.task_type, exc))
            return item
        item.chunk = True
        try:  # a chunk's items in one call: half the time of one call per item
            item.args = list(self._list_of(spec.args_model).validate_python(call.items))
        except ValidationError:  # then item by item, each invalid one failing alone
            item.args = []
            for index, raw in enumerate(call.items):
                try:
                    item.args.append(spec.args_model.model_validate(raw))
                except ValidationError as exc:
                    item.args.append(None)
                    message = _invalid(call.task_type, exc)
                    item.errors[str(index)] = {"code": ErrorCode.INVALID_ARGS, "message": message}
        if not item.valid:  # nothing to run: the chunk's result is its errors
            item.outcome = runner.encode_chunk(item.args, [], item.errors)
        return item

    def _list_of(self, model: type[BaseModel]) -> TypeAdapter[list[BaseModel]]:
        adapter = self._lists.get(model)
        if adapter is None:
            adapter = self._lists[model] = TypeAdapter(list[model])  # type: ignore[valid-type]
        return adapter

    def _run(self, spec: TaskSpec, pending: list[Item]) -> None:
        # Cancels that came since the claim (during the batch's wait to fill) mark their
        # items now, so those never enter a call; later ones find them in runner.batch.
        self.runner.start_batch([i.ctx for i in pending if i.ctx is not None])
        while pending:
            for item in pending:
                if item.ctx is not None and item.ctx.cancelled():
                    item.outcome = canceled()
            pending = [i for i in pending if i.outcome is None]
            if not pending:
                return
            if self._call(spec, pending):
                return
            pending = [i for i in pending if i.outcome is None]

    def _call(self, spec: TaskSpec, pending: list[Item]) -> bool:
        """One handler call; True when every item has its outcome, False to call again
        with the items still pending."""
        ctxs = [i.ctx for i in pending if i.ctx is not None]
        # Only this call's items from here: a cancel for an item that already has its
        # outcome (canceled, or timed out in an earlier call) must not interrupt a call
        # it is not part of.
        self.runner.start_batch(ctxs)
        lead = ctxs[0]
        self.runner.current = lead  # the run the interrupts (and the watchdog) follow
        now = time.monotonic()
        left = min(c.claimed.timeout_s - (now - c.started_mono) for c in ctxs)
        args = [a for i in pending for a in i.valid]
        per_item = [c for i, c in zip(pending, ctxs, strict=True) for _ in i.valid]  # shared
        called = time.monotonic()
        values: Any = None
        try:
            with self.runner.interrupts.armed(max(left, 0.001), lead):
                if spec.batch is not None:
                    values = self._calls(spec, args, per_item)
                else:  # one record, one item: the handler takes (args, ctx)
                    values = [spec.handler(args[0], lead)]
        except TaskTimeout:
            self._timed_out(pending)
            return False
        except TaskCanceled:
            return False  # the canceled items end at the top of the next round
        except (TaskHandback, GpuFault, LeaseLost) as exc:
            # Hand-back and GPU fault: every unfinished item goes back; a lost lease (the
            # reaper already gave them all back): none is reported.
            outcome = self.runner.interrupted(exc, lead.claimed)
            for item in pending:
                item.outcome = outcome
            return True
        except Exception as exc:  # noqa: BLE001 - the handler's error is every item's outcome
            for item in pending:
                assert item.ctx is not None
                item.outcome = self.runner.failed(exc, item.claimed, item.ctx)
            return True
        finally:
            _share(pending, time.monotonic() - called, _sizes(spec, pending, values))
        self._results(pending, values, spec.batch is None)
        return True

    def _calls(self, spec: TaskSpec, args: list[BaseModel], ctxs: list[RunningTask]) -> Any:
        """The batched handler over ``args`` in calls of this worker's batch size; its
        values in order (what a call returned, when that is not a list)."""
        size = max(self.sizes.get(spec.name, len(args)), 1)
        if len(args) <= size:
            return spec.handler(args, ctxs)
        values: list[Any] = []
        for at in range(0, len(args), size):
            got = spec.handler(args[at : at + size], ctxs[at : at + size])
            if not isinstance(got, list):
                return got  # not one result per item: _results says so
            values.extend(got)
        return values

    @staticmethod
    def _timed_out(pending: list[Item]) -> None:
        now = time.monotonic()
        left = {
            id(i): i.claimed.timeout_s - (now - i.ctx.started_mono)
            for i in pending
            if i.ctx is not None
        }
        soonest = min(left.values())
        for item in pending:
            if left[id(item)] <= max(soonest, 0.01):
                seconds = item.claimed.timeout_s
                item.outcome = Outcome.fail(
                    ErrorCode.TIMEOUT, f"Ran past its timeout of {seconds:g} s."
                )

    def _results(self, pending: list[Item], values: Any, may_split: bool) -> None:
        wanted = sum(len(i.valid) for i in pending)
        if not isinstance(values, list) or len(values) != wanted:
            got = len(values) if isinstance(values, list) else type(values).__name__
            for item in pending:
                item.outcome = Outcome.fail(
                    ErrorCode.INVALID_RESULT,
                    f"A batched handler must return one result per item: {wanted} "
                    f"items, got {got}.",
                )
            return
        at = 0
        for item in pending:
            mine = values[at : at + len(item.valid)]
            at += len(item.valid)
            if item.ctx is not None and item.ctx.cancelled():
                item.outcome = canceled()
            elif item.chunk:
                item.outcome = self.runner.encode_chunk(item.args, mine, item.errors)
            elif item.claimed.parent:
                item.outcome = self.runner.encode_part(mine[0], item.claimed.merge)
            else:
                item.outcome = self.runner.encode_one(mine[0], may_split)


def _sizes(spec: TaskSpec, pending: list[Item], values: Any) -> list[float]:
    """Each record's part of a call: its valid items, or, when the type shares by a
    result field and every result has it, the sum of that field over its items."""
    equal = [float(len(item.valid)) for item in pending]
    field = spec.batch.share_by if spec.batch is not None else None
    if field is None or not isinstance(values, list) or len(values) != sum(equal):
        return equal
    sizes: list[float] = []
    at = 0
    for n in equal:
        mine = values[at : at + int(n)]
        at += int(n)
        got = [v.get(field) if isinstance(v, dict) else None for v in mine]
        counts = [g for g in got if isinstance(g, int) and not isinstance(g, bool) and g >= 0]
        if len(counts) != len(got):
            return equal
        sizes.append(float(sum(counts)))
    return sizes if sum(sizes) > 0 else equal


def _share(pending: list[Item], seconds: float, sizes: list[float]) -> None:
    """A call's time, shared by its records in proportion to their ``sizes``."""
    total = sum(sizes)
    for item, size in zip(pending, sizes, strict=True):
        item.device_s += seconds * size / total if total > 0 else 0.0


def _invalid(task_type: str, exc: ValidationError) -> str:
    return f"Invalid arguments for {task_type!r}: {exc}"


def _unrunnable(
    spec: TaskSpec | None, call: Call, has_file: bool, registry: Registry
) -> Outcome | None:
    """Why this worker cannot run the call (the API refuses all of these with a 422
    first; a worker checks again, for jobs written by other means), or None."""
    if spec is None:
        return Outcome.fail(
            ErrorCode.UNKNOWN_TASK_TYPE,
            f"This worker does not run task type {call.task_type!r}; it runs {registry.names()}.",
        )
    if call.items is not None and spec.batch is None:
        return Outcome.fail(
            ErrorCode.INVALID_ARGS, f"Task type {call.task_type!r} takes no chunks."
        )
    if spec.batch is not None and call.file is not None:
        return Outcome.fail(ErrorCode.INVALID_ARGS, "A batched task type takes no file.")
    if spec.file == "required" and not has_file:
        return Outcome.fail(
            ErrorCode.INVALID_ARGS, f"Task type {call.task_type!r} needs an uploaded file."
        )
    return None
