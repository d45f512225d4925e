"""Task routes: submit, read and cancel (``docs/design.md``, "HTTP API").

``POST /tasks`` with ``Prefer: wait=N`` and ``GET /tasks/<id>?wait=N`` wait for the
task through the process's :class:`dispatcher.api.waiters.Waiters`; the event stream
is in :mod:`dispatcher.api.routes.events`.
"""

from __future__ import annotations

import logging
import re
from contextlib import nullcontext
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError

from dispatcher.api.admit import admit
from dispatcher.api.auth import Principal
from dispatcher.api.bulk import JSON_LINES, parse_bulk, split_item_id
from dispatcher.api.deps import Services, add_headers, caller, extra_headers, services
from dispatcher.api.errors import ApiError, error_responses
from dispatcher.api.pool import ClassState
from dispatcher.api.refusals import backpressure as _backpressure
from dispatcher.api.store import SubmitResult, record_of
from dispatcher.api.submission import content_type, json_body, parse_submission
from dispatcher.api.task_request import json_schema, upload_schema
from dispatcher.api.waiters import Watch, unless_disconnected
from dispatcher.contract.jobs import FINAL, chunk_item

__all__ = ["router"]

router = APIRouter()
log = logging.getLogger("gpulane.api")

_DELTA_SECONDS = re.compile(r"[0-9]{1,64}")  # any size: clamped to wait_max_s
# ?wait= as the OpenAPI schema declares it; anything else is a 400.
_WAIT_PATTERN = r"^[0-9]{1,9}(\.[0-9]{1,6})?$"
_WAIT_FORM = re.compile(_WAIT_PATTERN)

# The task model's schemas (dispatcher/api/task_request.py); GET /openapi.json narrows
# them per task type of the catalog (dispatcher/api/openapi.py).
_SUBMIT_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": json_schema()},
            "multipart/form-data": {"schema": upload_schema()},
        },
    }
}


def prefer_wait(values: list[str], max_s: float) -> int | None:
    """Seconds of ``Prefer: wait=N`` (RFC 7240) clamped to ``max_s``, or None. A
    preference is a hint: one that is malformed (not delta-seconds) is ignored, as the
    RFC asks; the last well-formed ``wait`` wins."""
    found: int | None = None
    for value in values:
        for preference in value[:1024].split(","):
            name, _, rest = preference.split(";", 1)[0].partition("=")
            word = rest.strip().strip('"')
            if name.strip().lower() == "wait" and _DELTA_SECONDS.fullmatch(word):
                found = int(word)
    if not found:
        return None
    return min(found, int(max_s)) or None


def query_wait(raw: str | None, max_s: float) -> float:
    """``?wait=N``: seconds to wait (0: none), clamped to ``max_s``; 400 unless it is a
    plain decimal number (the schema's pattern: digits, optionally a fraction)."""
    if raw is None:
        return 0.0
    if not _WAIT_FORM.fullmatch(raw):
        message = f"wait must be a number of seconds, 0 to {max_s:g}; got {raw[:40]!r}."
        raise ApiError(400, "invalid_request", message)
    return min(float(raw), max_s)


_ACCEPTED = {
    "type": "object",
    "required": ["id", "status", "type", "class", "position", "estimated_wait_s"],
    "properties": {
        "id": {"type": "string"},
        "status": {"type": "string"},
        "type": {"type": "string"},
        "class": {"type": "string"},
        "position": {"type": ["integer", "null"]},
        "estimated_wait_s": {"type": ["number", "null"]},
    },
}
_SUBMIT_RESPONSES: dict[int | str, dict[str, Any]] = {
    202: {
        "description": "Accepted and queued.",
        "content": {"application/json": {"schema": _ACCEPTED}},
    },
    200: {
        "description": "Idempotent replay of an earlier identical request.",
        "content": {"application/json": {"schema": _ACCEPTED}},
    },
    **error_responses(400, 401, 413, 422, 429, 503),
}
_RECORD = {
    "description": "The task record.",
    "content": {"application/json": {"schema": {"type": "object"}}},
}
_CANCEL_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {**_RECORD, "description": "Canceled (it was queued); the record."},
    202: {**_RECORD, "description": "Cancel requested (it is running); the record."},
    **error_responses(401, 404, 409, 429, 503),
}


def _class_headers(state: ClassState) -> dict[str, str]:
    return _backpressure(state.depth, state.estimated_wait_s, state.pressure)


@router.post(
    "/tasks",
    status_code=202,
    openapi_extra=_SUBMIT_BODY,
    tags=["tasks"],
    responses=_SUBMIT_RESPONSES,
    response_model=None,
)
async def submit_task(request: Request) -> JSONResponse:
    """Submit a task (JSON, or multipart with a `file`). 202 with its id and queue position."""
    svc = services(request)
    snap = await svc.pool.cached()
    add_headers(request, _class_headers(snap.classes[svc.settings.default_class]))
    principal = await caller(request)
    kind = content_type(request)
    raw = None
    if kind in JSON_LINES or kind == "application/json":
        raw = await json_body(request, svc.settings, kind in JSON_LINES)
        if kind in JSON_LINES or raw.lstrip()[:1] == b"[":
            return await _submit_bulk(request, svc, principal, raw, kind in JSON_LINES)
    sub = await parse_submission(request, principal, svc.settings, svc.catalog, raw)
    add_headers(request, _class_headers(snap.classes[sub.cls]))
    record = record_of(sub)
    wait_s = prefer_wait(request.headers.getlist("prefer"), svc.settings.wait_max_s)
    # Prefer: wait watches the task before it exists: its first read is its final one.
    with svc.waiters.watch(record.task_id) if wait_s is not None else nullcontext() as watch:
        result = await admit(svc, sub, [record])
        if result.verdict == "idempotency_key_reused":
            raise ApiError(
                422,
                "idempotency_key_reused",
                f"This Idempotency-Key was first used for another request "
                f"(task {result.task_id}); use a new key for a new request.",
            )
        headers = _accepted_headers(request, result)
        if wait_s is not None:
            # A replay answers with the first request's task, which this watch is not on.
            fresh = watch if result.task_id == record.task_id else None
            final = await _wait_final(request, svc, result.task_id, principal, wait_s, fresh)
            if final is not None:  # it ended within Prefer: wait: 200 with the final record
                headers["Preference-Applied"] = f"wait={wait_s}"
                return JSONResponse(final, status_code=200, headers=headers)
    replay = result.verdict == "duplicate"
    est = result.estimated_wait_s
    body: dict[str, Any] = {
        "id": result.task_id,
        "status": result.status,
        "type": result.task_type,
        "class": result.cls,
        "position": None if replay else result.position,
        "estimated_wait_s": None if replay or est is None else round(est, 3),
    }
    return JSONResponse(body, status_code=200 if replay else 202, headers=headers)


async def _submit_bulk(
    request: Request, svc: Services, principal: Principal, body: bytes, json_lines: bool
) -> JSONResponse:
    """Many tasks in one request, admitted whole (202 with one id per task) or refused
    whole; an invalid task refuses it with 422 naming its index."""
    if request.headers.get("idempotency-key") is not None:
        message = (
            "Idempotency-Key is for one task; a bulk submit is refused whole or accepted whole."
        )
        raise ApiError(422, "invalid_request", message)
    bulk = await parse_bulk(body, json_lines, principal, svc.settings, svc.catalog)
    sub = bulk.sub
    snap = await svc.pool.cached()
    add_headers(request, _class_headers(snap.classes[sub.cls]))
    result = await admit(svc, sub, bulk.records)
    headers = _accepted_headers(request, result)
    est = result.estimated_wait_s
    answer = {
        "class": sub.cls,
        "count": bulk.items,
        "ids": bulk.ids,
        "position": result.position,
        "estimated_wait_s": None if est is None else round(est, 3),
    }
    return JSONResponse(answer, status_code=202, headers=headers)


def _accepted_headers(request: Request, result: SubmitResult) -> dict[str, str]:
    """What every accepted submit answers with (a 202, a replay's 200, the final
    record's 200): its Location, then ``Idempotent-Replayed`` for a replay, else the
    backpressure signals."""
    headers = {**extra_headers(request), "Location": f"/tasks/{result.task_id}"}
    if result.verdict == "duplicate":
        headers["Idempotent-Replayed"] = "true"
        return headers
    headers.update(_backpressure(result.depth, result.estimated_wait_s, result.pressure))
    return headers


async def _wait_final(
    request: Request,
    svc: Services,
    task_id: str,
    principal: Principal,
    wait_s: float,
    fresh: Watch | None,
) -> dict[str, Any] | None:
    """The record once final within ``wait_s``, else None (also if the client left, or
    Redis failed meanwhile: the task is accepted, so the answer is the usual 202 with
    its id, never a 503 that would invite a duplicate submit). ``fresh``: a watch on
    the task registered before it was created, else None."""
    scope = principal.task_scope
    if fresh is not None:
        work = svc.waiters.wait_final(fresh, scope, wait_s, unread=False)
    else:
        work = svc.waiters.until_final(task_id, scope, wait_s)
    try:
        record = await unless_disconnected(request.receive, work)
    except RedisError as exc:
        log.warning("Prefer: wait gave up on %s: %s", task_id, exc)
        return None
    return record if record is not None and record["status"] in FINAL else None


def _not_found(task_id: str) -> ApiError:
    return ApiError(404, "not_found", f"No task {task_id[:64]!r}.")


_WAIT_DOC = (
    "Seconds to wait for the task to be final (absent or 0: answer at once; longer than "
    "wait_max_s, 60 by default, is clamped). Answers the moment it is final, else "
    "with the live record after them."
)


@router.get(
    "/tasks/{task_id}",
    tags=["tasks"],
    responses={200: _RECORD, **error_responses(400, 401, 404, 429, 503)},
    response_model=None,
)
async def get_task(
    task_id: str,
    request: Request,
    # Parsed here (400, not 422); the pattern tells clients and schema checkers its form.
    wait: str | None = Query(
        None, description=_WAIT_DOC, json_schema_extra={"pattern": _WAIT_PATTERN}
    ),
) -> JSONResponse:
    """The task record: status, position, progress, result or error, timings. With
    `?wait=N`: as soon as the task is final, or as it is after N seconds."""
    svc = services(request)
    principal = await caller(request)
    wait_s = query_wait(wait, svc.settings.wait_max_s)
    record_id, index = split_item_id(task_id)  # an item of a chunk reads the chunk
    if len(task_id) > 64:
        raise _not_found(task_id)
    # A long-poll watches before its first read, so that read is the only one until a
    # change that may end the task (no second read to start the wait).
    with svc.waiters.watch(record_id) if wait_s > 0 else nullcontext() as watch:
        record = await svc.store.get(record_id, principal.task_scope)
        if record is None or (index is not None and not index < (record["items"] or 0)):
            raise _not_found(task_id)
        if watch is not None and record["status"] not in FINAL:
            work = svc.waiters.wait_final(watch, principal.task_scope, wait_s, unread=False)
            record = await unless_disconnected(request.receive, work) or record
    if index is not None:
        record = chunk_item(record, index)
    # Encoded as it is (not walked by FastAPI's encoder, which recursed out on a deep
    # result): a task's result may nest deeper than a request may.
    return JSONResponse(record, headers=extra_headers(request))


@router.delete("/tasks/{task_id}", tags=["tasks"], responses=_CANCEL_RESPONSES, response_model=None)
async def cancel_task(task_id: str, request: Request) -> JSONResponse:
    """Cancel: a queued task at once (200), a running one by its worker (202)."""
    svc = services(request)
    principal = await caller(request)
    if len(task_id) > 64:
        raise _not_found(task_id)
    chunk, index = split_item_id(task_id)
    if index is not None:  # its chunk runs as one: canceling it would cancel the others
        message = (
            f"Task {task_id!r} is item {index} of chunk {chunk!r}, which runs as one; "
            f"DELETE /tasks/{chunk} cancels the whole chunk."
        )
        raise ApiError(409, "part_of_chunk", message, chunk=chunk)
    result = await svc.store.cancel(task_id, principal.task_scope)
    if result.verdict == "not_found":
        raise _not_found(task_id)
    if result.verdict == "part_of":  # its parent's other parts would run on for nothing
        message = (
            f"Task {task_id!r} is a part of task {result.parent!r}; "
            f"DELETE /tasks/{result.parent} cancels it with all its parts."
        )
        raise ApiError(409, "part_of_task", message, parent=result.parent)
    if result.verdict == "conflict":
        message = f"Task {task_id!r} already ended ({result.status})."
        raise ApiError(409, "conflict", message, status=result.status)
    if result.verdict == "canceled":  # no worker will report it
        svc.recorder.count("finished", result.cls, result.task_type, "canceled", n=result.items)
    record = await svc.store.get(task_id, principal.task_scope)
    status = 200 if result.verdict == "canceled" else 202
    return JSONResponse(record, status_code=status, headers=extra_headers(request))
