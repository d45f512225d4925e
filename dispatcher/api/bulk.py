"""Requests of many items: a bulk ``POST /tasks`` and the inputs of ``/v1/embeddings``.

A request's items travel together (``docs/design.md`` §4). Items of a batched type are
packed, in order, into *chunks* of up to the type's batch size: one record each, so
one claim takes a whole batch and one report ends it, and the request is admitted as
one unit sized in items (``submit.lua``). An item of a type that is not batched is a
task of its own, so the pool spreads such items over its workers. A chunk's item
``k`` is read as the task ``<chunk id>.<k>`` (``GET /tasks/<id>``).

A bulk submit is a JSON array of task objects (``application/json``) or one task
object per line (``application/x-ndjson``, ``application/jsonl``). Every task is
checked as a single ``POST /tasks`` body is; the first invalid one refuses the whole
request (422 naming its index) and nothing is enqueued. All tasks go to one class.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from dispatcher.api.auth import Principal
from dispatcher.api.errors import ApiError
from dispatcher.api.store import Record, Submission
from dispatcher.api.submission import submission_of, too_large
from dispatcher.api.task_types import Catalog
from dispatcher.contract import vectors
from dispatcher.contract.jobs import encode_call, json_bytes
from dispatcher.contract.settings import Settings
from dispatcher.contract.strict_json import loads_strict

__all__ = ["JSON_LINES", "Bulk", "Packer", "fits_ever", "parse_bulk", "split_item_id"]

JSON_LINES = frozenset({"application/x-ndjson", "application/jsonl", "application/x-jsonlines"})


@dataclass(frozen=True)
class Bulk:
    """A validated request of many items: ``sub`` carries its class and tenant (its
    first task's), ``records`` what is stored, ``ids`` one per item, in order."""

    sub: Submission
    records: list[Record]
    ids: list[str]

    @property
    def items(self) -> int:
        return len(self.ids)


def split_item_id(task_id: str) -> tuple[str, int | None]:
    """``<chunk id>.<k>`` -> (chunk id, k); any other id -> (id, None)."""
    head, dot, tail = task_id.rpartition(".")
    if dot and head and tail.isascii() and tail.isdigit() and len(tail) <= 6:
        return head, int(tail)
    return task_id, None


# A chunk's args stay well under what a worker inflates (64 MiB, jobs._MAX_CALL_BYTES).
MAX_CHUNK_ARGS_BYTES = 16 * 1024 * 1024


class Packer:
    """Packs items, in order, into records: consecutive items of one batched type (and
    one timeout and GPU need) share a chunk of up to ``chunk`` items, and of at most
    :data:`MAX_CHUNK_ARGS_BYTES` of args."""

    def __init__(self, encoding_format: str = vectors.FLOAT) -> None:
        self.encoding_format = encoding_format  # every record's (see Record)
        self.records: list[Record] = []
        self.ids: list[str] = []
        self._open: list[dict[str, Any]] = []
        self._bytes = 0
        self._key: tuple[str, float, int, int, bool] | None = None

    def add(
        self,
        task_type: str,
        args: dict[str, Any],
        timeout_s: float,
        gpu_mb: int,
        chunk: int,
        size: int = 0,
        routed: bool = False,
    ) -> None:
        """Add an item (``size``: its args' JSON length, when the caller knows it;
        ``routed``: a backend model's type, see :class:`Record`)."""
        key = (task_type, timeout_s, gpu_mb, chunk, routed)
        full = len(self._open) >= chunk or self._bytes + size > MAX_CHUNK_ARGS_BYTES
        if key != self._key or full:
            self._close()
            self._key = key
        self._open.append(args)
        self._bytes += size
        if chunk <= 1:
            self._close()

    def done(self) -> tuple[list[Record], list[str]]:
        self._close()
        return self.records, self.ids

    def _close(self) -> None:
        if not self._open or self._key is None:
            return
        task_type, timeout_s, gpu_mb, _, routed = self._key
        items, self._open, self._bytes = self._open, [], 0
        if len(items) == 1:  # a lone item is a task: its id and record as any task's
            data = encode_call(task_type, items[0])
            record = Record(
                task_type,
                data,
                timeout_s,
                1,
                gpu_mb,
                routed=routed,
                encoding_format=self.encoding_format,
            )
            self.ids.append(record.task_id)
        else:
            data = encode_call(task_type, {}, items=items)
            record = Record(
                task_type, data, timeout_s, len(items), gpu_mb, encoding_format=self.encoding_format
            )
            self.ids.extend(f"{record.task_id}.{k}" for k in range(len(items)))
        self.records.append(record)


def _tasks(raw: bytes, json_lines: bool, limit: int) -> list[Any]:
    """The task objects of a bulk body (not yet checked)."""
    try:
        if json_lines:
            values = [loads_strict(line) for line in raw.splitlines() if line.strip()]
        else:
            values = loads_strict(raw)
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, "invalid_request", f"The body is not valid JSON: {exc}.") from exc
    if not isinstance(values, list) or not values:
        raise ApiError(400, "invalid_request", "A bulk submit holds one task or more.")
    if len(values) > limit:
        raise ApiError(
            413,
            "payload_too_large",
            f"The request holds {len(values)} tasks; a bulk submit holds at most {limit} "
            "(bulk_max_tasks).",
            limit_tasks=limit,
        )
    return values


def _at(index: int, exc: ApiError) -> ApiError:
    """A task's error as the bulk request's: 422 (400 for malformed JSON stays 400's
    code), naming the task's index."""
    extra = {k: v for k, v in exc.extra.items() if k != "index"}
    status = exc.status if exc.status != 400 else 422
    return ApiError(status, exc.code, f"tasks[{index}]: {exc.message}", index=index, **extra)


async def parse_bulk(
    raw: bytes, json_lines: bool, principal: Principal, settings: Settings, catalog: Catalog
) -> Bulk:
    """Validate every task of a bulk body and pack them; :class:`ApiError` for the first
    one that is invalid (nothing is enqueued)."""
    # Parsing megabytes of JSON off the event loop: other requests go on meanwhile.
    values = await asyncio.to_thread(_tasks, raw, json_lines, settings.bulk_max_tasks)
    packer = Packer()
    first: Submission | None = None
    # Each distinct task is checked once: a bulk often repeats one (same type, args).
    checked: dict[bytes, tuple[Submission, int]] = {}
    for index, value in enumerate(values):
        text = json_bytes(value)
        try:
            if len(text) > settings.max_body_bytes:  # what one POST /tasks may carry
                raise too_large(settings.max_body_bytes, "task")
            sub, chunk = checked.get(text) or await _checked(value, principal, settings, catalog)
        except ApiError as exc:
            raise _at(index, exc) from None
        checked[text] = (sub, chunk)
        if first is None:
            first = sub
        elif sub.cls != first.cls:
            message = f"class {sub.cls!r}: a bulk submit goes to one class ({first.cls!r})."
            raise _at(index, ApiError(422, "invalid_request", message))
        packer.add(
            sub.task_type, sub.args, sub.timeout_s, sub.gpu_memory_mb, chunk, len(text), sub.routed
        )
    assert first is not None  # _tasks refuses an empty list
    records, ids = packer.done()
    fits_ever(len(ids), len(records), first, settings)
    return Bulk(first, records, ids)


async def _checked(
    value: Any, principal: Principal, settings: Settings, catalog: Catalog
) -> tuple[Submission, int]:
    """A task checked as a single submit's body is, and its type's chunk size."""
    sub = await submission_of(value, principal, settings, catalog)
    info = await catalog.lookup(sub.task_type)
    return sub, info.chunk_size(settings) if info else 1


def fits_ever(items: int, records: int, sub: Submission, settings: Settings) -> None:
    """422 for a request no retry could ever fit (a 503 or 429 would invite one)."""
    cfg = settings.classes[sub.cls]
    if items > cfg.max_queued:
        message = (
            f"The request holds {items} items; class {sub.cls!r} queues at most {cfg.max_queued}."
        )
        raise ApiError(422, "too_many_items", message, max_queued=cfg.max_queued)
    if sub.max_in_flight and records > sub.max_in_flight:
        message = (
            f"The request is {records} tasks and chunks; this key's max_in_flight is "
            f"{sub.max_in_flight}."
        )
        raise ApiError(422, "too_many_items", message, max_in_flight=sub.max_in_flight)
