"""The task as stored in Redis: an RQ job hash that gpulane extends.

A task is an RQ job (``rq:job:<id>``) written in RQ's own format with RQ's JSON
serializer, so ``rq.job.Job.fetch(id, serializer=JSONSerializer)`` reads it. Its
``data`` is always a call of one fixed entry tag, :data:`ENTRY_POINT` (``gpulane.run``, a
name of its own, not a module path: renaming packages never touches stored jobs), with
the task type as data::

    zlib(json(["gpulane.run", null, [<type>, <args>], {"file": <meta> | absent}]))

A *chunk* (several items of one batched type travelling as one record, see
``docs/design.md`` §4) calls it with its items' args instead, and ``args`` empty::

    zlib(json(["gpulane.run", null, [<type>, {}], {"items": [<args>, ...]}]))

Jobs written before the tag name ``worker.entry.run`` (:data:`LEGACY_ENTRY_POINTS`),
and still run.

Workers refuse any other call (invariant 3): nothing names a function to run.

Hash fields. RQ's: ``data``, ``origin`` (the class), ``status`` (RQ's vocabulary, see
:data:`PUBLIC_STATUS`), ``created_at``, ``enqueued_at``, ``started_at``, ``ended_at``,
``last_heartbeat`` (ISO 8601, Redis clock), ``description``, ``timeout`` (whole
seconds, as RQ reads it), ``result_ttl``, ``failure_ttl``, ``worker_name``, ``result``
(JSON).

gpulane's: ``type``, ``tenant``, ``timeout_s`` (the exact limit); ``created_ms``,
``started_ms``, ``ended_ms`` (epoch ms, Redis clock, so hosts with skewed clocks
agree); ``attempts`` (times started); ``lost`` (times its worker died holding it);
``quota`` (``1`` when it counts against its tenant's max_in_flight); ``has_file``;
``progress`` and ``error`` (JSON objects); ``device`` (JSON of the worker's device);
``history`` (JSON list of attempts that did not end normally); ``cancel`` (``1`` once
a cancel was requested); ``lane`` (the tenant whose fair-share lane holds it while
queued, '' without fair share); ``gpu_mb`` (GPU memory it needs, MB; 0: any worker);
``items`` (a chunk's item count; absent on a task, which is one item); a task split
into parts, and its parts, have the fields of :mod:`dispatcher.contract.parts`. A chunk's
``result`` is ``{"results": [<value or null>, ...], "errors": {"<index>": <error>}}``:
one entry per item, in order (:func:`chunk_item`).
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Literal

import orjson

__all__ = [
    "ENTRY_POINT",
    "FINAL",
    "FINAL_STATUSES",
    "LEGACY_ENTRY_POINTS",
    "PUBLIC_STATUS",
    "RECORD_FIELDS",
    "Call",
    "CallRefused",
    "ErrorCode",
    "FileMeta",
    "RqStatus",
    "TaskStatus",
    "chunk_item",
    "decode_call",
    "encode_call",
    "iso_ms",
    "json_bytes",
    "lua_statuses",
    "record_from_fields",
]

ENTRY_POINT = "gpulane.run"
LEGACY_ENTRY_POINTS = frozenset({"worker.entry.run"})  # what older versions wrote


class TaskStatus(StrEnum):
    """A task's status in the HTTP API (``GET /tasks/<id>``), the clients and the CLI."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELED = "canceled"


class ErrorCode(StrEnum):
    """The error codes gpulane itself gives a task (``error.code`` of its record); a
    handler's own ``TaskFailure`` codes are its own."""

    CANCELED = "canceled"
    TIMEOUT = "timeout"
    WORKER_LOST = "worker_lost"
    GPU_FAULT = "gpu_fault"
    GPU_OUT_OF_MEMORY = "gpu_out_of_memory"
    INVALID_ARGS = "invalid_args"
    INVALID_RESULT = "invalid_result"
    RESULT_TOO_LARGE = "result_too_large"
    REFUSED = "refused"
    UNKNOWN_TASK_TYPE = "unknown_task_type"
    TASK_ERROR = "task_error"
    BACKEND_ERROR = "backend_error"


# The statuses a task never leaves.
FINAL: frozenset[TaskStatus] = frozenset(
    {TaskStatus.SUCCEEDED, TaskStatus.FAILED, TaskStatus.CANCELED}
)

# RQ's vocabulary, as stored in the job hash's ``status`` field.
RqStatus = Literal["queued", "started", "finished", "failed", "canceled", "stopped"]

# RQ's job status -> the public status of the HTTP API.
PUBLIC_STATUS: dict[str, TaskStatus] = {
    "queued": TaskStatus.QUEUED,
    "started": TaskStatus.RUNNING,
    "finished": TaskStatus.SUCCEEDED,
    "failed": TaskStatus.FAILED,
    "canceled": TaskStatus.CANCELED,
    "stopped": TaskStatus.CANCELED,
}
# The same final set in RQ's vocabulary (what Lua and the bench read in job hashes).
FINAL_STATUSES: frozenset[str] = frozenset(
    rq for rq, public in PUBLIC_STATUS.items() if public in FINAL
)


def lua_statuses() -> str:
    """Lua's ``FINAL`` set, generated from :data:`FINAL_STATUSES` (the scripts'
    prelude), so the scripts and the Python side cannot disagree on what is final."""
    entries = ", ".join(f"{status} = true" for status in sorted(FINAL_STATUSES))
    return f"local FINAL = {{{entries}}}\n"


# What GET /tasks/<id> reads, in this order (get.lua takes the list as ARGV).
RECORD_FIELDS = (
    "status",
    "type",
    "origin",
    "tenant",
    "progress",
    "result",
    "error",
    "attempts",
    "worker_name",
    "device",
    "created_ms",
    "started_ms",
    "ended_ms",
    "cancel",
    "gpu_mb",
    "items",
    "parts",
    "left",
    "entries",
    "pbytes",
    "parent",
    "part",
    "lane",  # last: get.lua reads it for a fair-share position; not in the record
)

# Bound on a decompressed call: a hostile hash cannot make a worker inflate gigabytes.
_MAX_CALL_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class FileMeta:
    name: str
    content_type: str
    size: int

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "content_type": self.content_type, "size": self.size}


@dataclass(frozen=True)
class Call:
    task_type: str
    args: dict[str, Any]
    file: FileMeta | None
    items: list[dict[str, Any]] | None = None  # a chunk's items' args; None: a task


class CallRefused(ValueError):
    """The job's data is not a call of gpulane's entry point; the worker must not run it."""


def encode_call(
    task_type: str,
    args: dict[str, Any],
    file: FileMeta | None = None,
    items: list[dict[str, Any]] | None = None,
) -> bytes:
    """A task's call, or (``items``) a chunk's: UTF-8 JSON (orjson: a chunk of texts is
    encoded on the API's request path, and no escaping multiplies non-ASCII text),
    compressed fast (level 1; :func:`_deflate`)."""
    kwargs: dict[str, Any] = {"file": file.to_json()} if file else {}
    if items is not None:
        kwargs["items"] = items
    payload = [ENTRY_POINT, None, [task_type, args], kwargs]
    return _deflate(json_bytes(payload))


def _deflate(data: bytes) -> bytes:
    """zlib at level 1 with a window (and memory) no larger than ``data`` needs: zlib's
    default state is about 256 KB, set up for every call, which made compressing a
    140-byte call cost 62 us, a tenth of the API's CPU for a single submit; sized to
    it, 7 us. The window reaches back over the whole call (deflate reaches 262 bytes
    less than its window), so the output is what the default gives, give or take a few
    bytes of block layout. Any zlib reader inflates it (the window is in the header),
    RQ's too."""
    wbits = min(max((len(data) + 261).bit_length(), 9), 15)  # zlib's range: 512 B-32 KiB
    deflater = zlib.compressobj(1, zlib.DEFLATED, wbits, max(1, wbits - 7))
    return deflater.compress(data) + deflater.flush()


def json_bytes(value: Any) -> bytes:
    """UTF-8 JSON of a client's value, at orjson's speed; what orjson refuses (an
    integer past 64 bits, which a client may send) by the json module."""
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def _inflate(data: bytes) -> bytes:
    try:
        inflater = zlib.decompressobj()
        out = inflater.decompress(data, _MAX_CALL_BYTES)
    except zlib.error:
        return data  # RQ also accepts uncompressed data
    if inflater.unconsumed_tail:
        raise CallRefused("job data is larger than a task call may be")
    return out


def decode_call(data: bytes) -> Call:
    """Parse a job's ``data``; raise :class:`CallRefused` unless it calls :data:`ENTRY_POINT`."""
    raw = _inflate(data)
    try:
        payload = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CallRefused("job data is not JSON (pickled or foreign job)") from exc
    if not (isinstance(payload, list) and len(payload) == 4):
        raise CallRefused("job data is not an RQ call")
    func, instance, args, kwargs = payload
    if (func != ENTRY_POINT and func not in LEGACY_ENTRY_POINTS) or instance is not None:
        raise CallRefused(f"job calls {func!r}; workers run only {ENTRY_POINT!r}")
    if not (
        isinstance(args, list)
        and len(args) == 2
        and isinstance(args[0], str)
        and isinstance(args[1], dict)
        and isinstance(kwargs, dict)
        and set(kwargs) <= {"file", "items"}
    ):
        raise CallRefused("job arguments do not match the entry point's signature")
    items = kwargs.get("items")
    if items is not None and not (
        isinstance(items, list) and items and all(isinstance(i, dict) for i in items)
    ):
        raise CallRefused("job items are not a list of argument objects")
    meta = kwargs.get("file")
    file = None
    if meta is not None:
        try:
            file = FileMeta(str(meta["name"]), str(meta["content_type"]), int(meta["size"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise CallRefused("job file description is malformed") from exc
    return Call(task_type=args[0], args=args[1], file=file, items=items)


def chunk_item(record: dict[str, Any], index: int) -> dict[str, Any]:
    """Item ``index`` of a chunk's public record, as a task's record reads: the chunk's
    status and times, the item's own result or error. A chunk that succeeded may hold
    a failed item (its args were invalid, its handler gave it a TaskFailure)."""
    out = {**record, "id": f"{record['id']}.{index}", "chunk": record["id"], "items": None}
    result = record.get("result")
    if record["status"] == TaskStatus.SUCCEEDED and isinstance(result, dict):
        error = (result.get("errors") or {}).get(str(index))
        if error is not None:
            out.update(status=TaskStatus.FAILED, result=None, error=error)
        else:
            values = result.get("results") or []
            out["result"] = values[index] if index < len(values) else None
    return out


def iso_ms(ms: int | None) -> str | None:
    if ms is None:
        return None
    moment = datetime.fromtimestamp(ms / 1000, UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _int(raw: bytes | None) -> int | None:
    return int(raw) if raw else None


def _json(raw: bytes | None) -> Any:
    # orjson: a chunk's result holds thousands of vectors; it refuses NaN as json does.
    return orjson.loads(raw) if raw else None


def record_from_fields(task_id: str, values: list[Any], position: int | None) -> dict[str, Any]:
    """The public task record (``GET /tasks/<id>``) from :data:`RECORD_FIELDS` values."""
    raw = dict(zip(RECORD_FIELDS, values, strict=True))
    created, started, ended = (_int(raw[f]) for f in ("created_ms", "started_ms", "ended_ms"))
    status = PUBLIC_STATUS.get(raw["status"].decode(), "failed")
    return {
        "id": task_id,
        "type": raw["type"].decode() if raw["type"] else None,
        "class": raw["origin"].decode() if raw["origin"] else None,
        "status": status,
        "position": position if status == "queued" else None,
        "progress": _json(raw["progress"]),
        "result": _json(raw["result"]) if status == "succeeded" else None,
        "error": _json(raw["error"]),
        "attempts": _int(raw["attempts"]) or 0,
        "worker": raw["worker_name"].decode() if raw["worker_name"] else None,
        "device": _json(raw["device"]),
        "created_at": iso_ms(created),
        "started_at": iso_ms(started),
        "finished_at": iso_ms(ended),
        "queue_wait_s": (started - created) / 1000 if started and created else None,
        "run_s": (ended - started) / 1000 if ended and started else None,
        "cancel_requested": raw["cancel"] == b"1" and status == "running",
        "gpu_memory_mb": _int(raw["gpu_mb"]) or 0,
        "items": _int(raw["items"]),  # a chunk's item count; None: a task
        "parts": _parts(raw),
        # A part's: its parent's id and its index there.
        "parent": raw["parent"].decode() if raw["parent"] else None,
        "part": _int(raw["part"]),
        # Where the result is read when the record does not hold it (a task's parts'
        # results past max_result_bytes): set by the API (dispatcher/api/parts.py).
        "result_url": None,
    }


def _parts(raw: dict[str, Any]) -> dict[str, int] | None:
    """A task split into parts: how many, how many succeeded, the entries and JSON
    bytes they stored; None for a task that did not split."""
    count = _int(raw["parts"])
    if count is None:
        return None
    return {
        "count": count,
        "done": count - (_int(raw["left"]) or 0),
        "entries": _int(raw["entries"]) or 0,
        "bytes": _int(raw["pbytes"]) or 0,
    }
