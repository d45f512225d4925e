"""What running a claimed task in the worker's own process needs (invariant 2: no
fork): outcomes, interrupts, the task's context and the :class:`Runner`'s state and
verdicts. The run path itself is :class:`worker.batching.BatchRunner`.

The handler runs in the main thread. It is stopped by raising an exception into that
thread from a signal handler: ``SIGALRM`` for its timeout, ``SIGUSR1`` when another
thread asks (a cancel, the end of the shutdown grace, a second SIGTERM, a GPU fault).
Both interrupt blocking calls such as ``time.sleep``. Code stuck in native code that
never returns to Python is the heartbeat's watchdog's business (it ends the process).
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from types import FrameType
from typing import Any, Protocol

import orjson

from dispatcher.contract.jobs import ErrorCode
from worker.claims import Claimed
from worker.gpu.health import classify, describe
from worker.registry import (
    Registry,
    Split,
    TaskCanceled,
    TaskFailure,
    TaskInterrupt,
    TaskTimeout,
    UploadedFile,
)
from worker.split import Splitter

__all__ = [
    "MAX_CHUNK_RESULT_BYTES",
    "RECORDED",
    "GpuFault",
    "Interrupts",
    "LeaseLost",
    "Outcome",
    "ProgressSink",
    "RunControl",
    "RunEnd",
    "Runner",
    "RunningTask",
    "TaskHandback",
    "canceled",
    "item_failure",
    "result_json",
]

log = logging.getLogger("gpulane.worker")


class TaskHandback(TaskInterrupt):
    """The worker is shutting down and the grace period is over: give the task back."""


class GpuFault(TaskInterrupt):
    """The heartbeat found the device lost or not answering: hand the task back."""


class LeaseLost(TaskInterrupt):
    """The heartbeat found the task no longer this run's (the worker lost its lease and
    the task was given back, or runs again elsewhere): stop and report nothing."""


class RunEnd(StrEnum):
    """How a run ended, as the worker reports it."""

    # Recorded by finish.lua, in RQ's vocabulary (RECORDED).
    FINISHED = "finished"
    FAILED = "failed"
    CANCELED = "canceled"
    # Handed back: untouched, at the head of its queue (a shutdown).
    RELEASE = "release"
    # Requeued behind the others (an error its type retries).
    RETRY = "retry"
    # A GPU fault: handed back as a lost attempt, which counts against max_attempts
    # like a dead worker's task; this worker leaves service.
    LOST = "lost"
    # The lease was lost: the task is no longer this run's; nothing is reported.
    ABANDON = "abandon"
    # The handler returned ctx.map: split.lua queues the parts; the task ends with them.
    SPLIT = "split"


# The ends a script records (finish.lua; split.lua for a split); the others go back to
# the queue (or nowhere).
RECORDED = frozenset({RunEnd.FINISHED, RunEnd.FAILED, RunEnd.CANCELED, RunEnd.SPLIT})


@dataclass(frozen=True)
class Outcome:
    """How a run ended (:class:`RunEnd`), with its result's JSON or its error."""

    status: RunEnd
    result_json: str = ""
    error: dict[str, Any] | None = None
    split: Split | None = None  # SPLIT: the parts
    entries: int = 0  # a part's result: how many entries it holds

    @staticmethod
    def fail(code: str, message: str) -> Outcome:
        return Outcome(RunEnd.FAILED, error={"code": code, "message": message})

    @staticmethod
    def lost(message: str) -> Outcome:
        return Outcome(RunEnd.LOST, error={"code": ErrorCode.GPU_FAULT, "message": message})


def canceled() -> Outcome:
    error = {"code": ErrorCode.CANCELED, "message": "Canceled while running."}
    return Outcome(RunEnd.CANCELED, error=error)


class Interrupts:
    """Raises a :class:`TaskInterrupt` in the main thread while a handler runs.

    Every request names the run it is for, so one that arrives as that run ends never
    stops the next one."""

    def __init__(self) -> None:
        self._armed_for: object | None = None
        self._pending: tuple[type[TaskInterrupt], object] | None = None
        self.reason = ""  # why the last request was made (GpuFault's message)
        self._main = threading.main_thread().ident or 0
        signal.signal(signal.SIGALRM, self._on_alarm)
        signal.signal(signal.SIGUSR1, self._on_request)

    @contextmanager
    def armed(self, timeout_s: float, run: object) -> Iterator[None]:
        self._armed_for = run
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            yield
        finally:
            self._armed_for = None
            self._pending = None
            signal.setitimer(signal.ITIMER_REAL, 0)

    def request(self, kind: type[TaskInterrupt], run: object, reason: str = "") -> None:
        """From any thread: stop ``run`` (a :class:`RunningTask`) with ``kind``."""
        self.reason = reason
        self._pending = (kind, run)
        signal.pthread_kill(self._main, signal.SIGUSR1)

    def _fire(self, kind: type[TaskInterrupt], run: object) -> None:
        if run is not None and run is self._armed_for:
            self._armed_for = None  # once: the handler's cleanup must not be interrupted
            raise kind()

    def _on_alarm(self, signum: int, frame: FrameType | None) -> None:
        self._fire(TaskTimeout, self._armed_for)

    def _on_request(self, signum: int, frame: FrameType | None) -> None:
        if self._pending is not None:
            self._fire(*self._pending)


ProgressSink = Callable[[Claimed, float, str], None]


class RunningTask:
    """The :class:`worker.registry.TaskContext` of one run."""

    _MIN_WRITE_INTERVAL_S = 0.25  # progress is for people; don't flood Redis

    def __init__(
        self,
        claimed: Claimed,
        task_type: str,
        file: UploadedFile | None,
        device: dict[str, Any],
        sink: ProgressSink,
        worker: str,
        splitter: Splitter | None = None,
    ) -> None:
        self.task_id = claimed.task_id
        self.task_type = task_type
        self.task_class = claimed.cls
        self.attempt = claimed.attempt
        self.file = file
        self.device = device
        self.claimed = claimed
        self.parent = claimed.parent or None
        self.part = claimed.part
        self.encoding_format = claimed.encoding_format
        self._splitter = splitter
        self.log = logging.LoggerAdapter(
            log, {"worker": worker, "task": self.task_id, "class": self.task_class}
        )
        self.started_mono = time.monotonic()  # the watchdog's clock (Redis' is elsewhere)
        self.latest_progress: dict[str, Any] | None = None
        self._sink = sink
        self._last_write = 0.0
        self._cancel = threading.Event()

    def progress(self, fraction: float, message: str = "") -> None:
        fraction = min(max(float(fraction), 0.0), 1.0)
        message = message[:500]
        self.latest_progress = {"fraction": round(fraction, 4), "message": message}
        now = time.monotonic()
        if now - self._last_write >= self._MIN_WRITE_INTERVAL_S:
            self._last_write = now
            self._sink(self.claimed, fraction, message)

    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def map(self, task_type: str, items: list[dict[str, Any]], **options: Any) -> Split:
        # TaskContext.map documents the options; Splitter.split checks them.
        if self._splitter is None:
            raise ValueError("this worker runs no splits")
        return self._splitter.split(self.parent, self.file, task_type, items, **options)

    def workers(self) -> int:
        return self._splitter.workers(self.task_class) if self._splitter is not None else 1

    def request_cancel(self) -> None:
        self._cancel.set()


class RunControl(Protocol):
    """What the heartbeat and the watchdog need of a worker's runs: the one in progress
    in the main thread (None: none, or runs not driven by interrupts, as a backend
    worker's), and how to cancel a task's run."""

    current: RunningTask | None

    def cancel(self, task_id: str) -> None: ...


class Runner:
    """What a run needs beyond its records: the registry, the interrupts, the run in
    progress (for cancels and the watchdog) and the verdicts on how it ended (never
    raising for a task's fault)."""

    def __init__(
        self,
        registry: Registry,
        interrupts: Interrupts,
        sink: ProgressSink,
        device: dict[str, Any],
        worker: str,
        max_result_bytes: int,
        splitter: Splitter | None = None,
    ) -> None:
        self.registry = registry
        self.splitter = splitter
        self.interrupts = interrupts
        self.sink = sink
        self.device = device
        self.worker = worker
        self.max_result_bytes = max_result_bytes
        self.current: RunningTask | None = None
        self.batch: list[RunningTask] = []  # the items of the batch running, if any
        # Cancels that came before their run started (between claim and here); bounded:
        # an id whose task already ended elsewhere would otherwise stay forever.
        self._early_cancels: deque[str] = deque(maxlen=64)
        self._lock = threading.Lock()

    def cancel(self, task_id: str) -> None:
        """From the heartbeat thread: stop the run of ``task_id`` now or, if it has not
        started yet, as soon as it does."""
        with self._lock:
            current = self.current
            runs = self.batch or ([current] if current is not None else [])
            target = next((run for run in runs if run.task_id == task_id), None)
            if target is None:
                self._early_cancels.append(task_id)
                return
        target.request_cancel()
        if current is not None:  # a batch between calls has none: its next round sees it
            self.interrupts.request(TaskCanceled, current)  # a batch's call reruns the rest

    def start_batch(self, runs: list[RunningTask]) -> None:
        """Make ``runs`` the items of the batch call about to start (each call of a
        batch names its own); cancels that came early mark their items."""
        with self._lock:
            self.batch = runs
            for run in runs:
                if run.task_id in self._early_cancels:
                    run.request_cancel()

    def end_batch(self) -> None:
        with self._lock:
            self.batch = []
            self.current = None

    def interrupted(self, exc: TaskInterrupt, claimed: Claimed) -> Outcome:
        if isinstance(exc, TaskTimeout):
            message = f"Ran past its timeout of {claimed.timeout_s:g} s."
            return Outcome.fail(ErrorCode.TIMEOUT, message)
        if isinstance(exc, TaskHandback):
            return Outcome(RunEnd.RELEASE)
        if isinstance(exc, GpuFault):
            return Outcome.lost(self.interrupts.reason or "Its GPU stopped answering.")
        if isinstance(exc, LeaseLost):
            return Outcome(RunEnd.ABANDON)
        return canceled()

    def failed(self, exc: Exception, claimed: Claimed, ctx: RunningTask) -> Outcome:
        gpu = self._gpu_outcome(exc, ctx)  # also a CUDA error wrapped in a TaskFailure
        if gpu is not None:
            return gpu
        if isinstance(exc, TaskFailure):
            return Outcome.fail(exc.code, exc.message)
        ctx.log.exception("task raised")
        if ctx.cancelled():  # a retry would run a task its client canceled
            return canceled()
        spec = self.registry.get(ctx.task_type)
        if spec is not None and claimed.attempt <= spec.retries:
            return Outcome(RunEnd.RETRY)
        return Outcome.fail(ErrorCode.TASK_ERROR, f"{type(exc).__name__}: {exc}")

    @staticmethod
    def _gpu_outcome(exc: BaseException, ctx: RunningTask) -> Outcome | None:
        """A fatal CUDA error or a GPU out-of-memory, as its outcome; else None."""
        kind = classify(exc)
        if kind is None:
            return None
        message = describe(exc)
        if kind == "oom":
            ctx.log.warning("task ran out of GPU memory: %s", message)
            oom = f"The GPU ran out of memory: {message}"
            return Outcome.fail(ErrorCode.GPU_OUT_OF_MEMORY, oom)
        ctx.log.error("fatal GPU error; the CUDA context is unusable: %s", message, exc_info=exc)
        return Outcome.lost(f"Fatal GPU error: {message}")

    def encode(self, value: Any, items: int = 1) -> Outcome:
        """The outcome of a result: its JSON, or why it has none. A chunk's result
        (``items`` of them) may be as large as that many tasks' results."""
        try:
            text = result_json(value)
        except Exception as exc:  # noqa: BLE001 - any refusal (deep nesting too) is the result's fault
            return Outcome.fail(ErrorCode.INVALID_RESULT, f"The result is not JSON: {exc}.")
        limit = min(self.max_result_bytes * items, MAX_CHUNK_RESULT_BYTES)
        if len(text) > limit:
            return Outcome.fail(
                ErrorCode.RESULT_TOO_LARGE,
                f"The result is {len(text)} bytes; the limit is {limit}.",
            )
        return Outcome(RunEnd.FINISHED, result_json=text)

    def encode_chunk(
        self, args: list[Any], values: list[Any], errors: dict[str, dict[str, str]]
    ) -> Outcome:
        """A chunk's outcome: ``{"results": [...], "errors": {index: error}}``, one
        entry per item (``args``: None for an item that failed validation, whose error
        ``errors`` holds already; ``values``: the handler's, for the others in order)."""
        results: list[Any] = []
        it = iter(values)
        for index, arg in enumerate(args):
            value = None if arg is None else next(it)
            failure = item_failure(value)
            if failure is not None:
                errors[str(index)] = failure
                value = None
            results.append(value)
        return self.encode({"results": results, "errors": errors}, len(args))

    def encode_one(self, value: Any, may_split: bool = False) -> Outcome:
        """A task's outcome from the value its handler gave for it (``may_split``: a
        handler of its own, which may return ``ctx.map``'s split)."""
        failure = item_failure(value)
        if failure is not None:
            return Outcome.fail(failure["code"], failure["message"])
        if isinstance(value, Split):
            if may_split:
                return Outcome(RunEnd.SPLIT, split=value)
            return Outcome.fail(ErrorCode.INVALID_RESULT, "A batched handler cannot split.")
        return self.encode(value)

    def encode_part(self, value: Any, merge: str) -> Outcome:
        """A part's outcome: its entries as a JSON list, the result's list at ``merge``
        (its parent's ``flatten``), or the whole result as the one entry."""
        failure = item_failure(value)
        if failure is not None:
            return Outcome.fail(failure["code"], failure["message"])
        if isinstance(value, Split):
            return Outcome.fail(ErrorCode.INVALID_RESULT, "A part cannot split again.")
        entries = value.get(merge) if merge and isinstance(value, dict) else [value]
        if not isinstance(entries, list):
            return Outcome.fail(
                ErrorCode.INVALID_RESULT, f"A part's result must hold a list at {merge!r}."
            )
        outcome = self.encode(entries)
        if outcome.status != RunEnd.FINISHED:
            return outcome
        return Outcome(RunEnd.FINISHED, outcome.result_json, entries=len(entries))


def item_failure(value: Any) -> dict[str, str] | None:
    """The error of an item a batched handler failed alone (it returned a
    ``TaskFailure`` or an exception in the item's place), else None."""
    if isinstance(value, TaskFailure):
        return {"code": value.code, "message": value.message}
    if isinstance(value, BaseException):
        return {"code": ErrorCode.TASK_ERROR, "message": f"{type(value).__name__}: {value}"}
    return None


_ORJSON = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS
# A chunk's result may be as large as its items' results, within what one Redis
# argument carries comfortably (proto-max-bulk-len is 512 MB).
MAX_CHUNK_RESULT_BYTES = 256 * 1024 * 1024


def result_json(value: Any) -> str:
    """A result as JSON, at orjson's speed (a chunk of embeddings is megabytes of
    floats), refusing what ``json.dumps(value, allow_nan=False)`` refuses. orjson writes
    NaN and infinities as ``null`` and refuses integers past 64 bits, so output with a
    ``null`` in it, or a value orjson refuses, is written again by the json module,
    which takes what orjson takes (numpy arrays and scalars, dates, UUIDs) through
    :func:`_like_orjson` and raises for NaN."""
    try:
        raw = orjson.dumps(value, option=_ORJSON)
    except (TypeError, orjson.JSONEncodeError):
        raw = b"null"
    if b"null" in raw:
        return json.dumps(value, allow_nan=False, separators=(",", ":"), default=_like_orjson)
    return raw.decode()


def _like_orjson(value: Any) -> Any:
    """What orjson writes for a type the json module does not know."""
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return value.tolist()
    if hasattr(value, "isoformat"):  # datetime, date, time
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")
