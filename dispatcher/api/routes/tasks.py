"""Task routes: submit, read and cancel (``docs/design.md``, "HTTP API")."""

from __future__ import annotations

import math
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from dispatcher.api import admission
from dispatcher.api.deps import Services, add_headers, caller, extra_headers, services
from dispatcher.api.errors import ApiError, error_responses
from dispatcher.api.pool import ClassState, Snapshot
from dispatcher.api.store import Submission, SubmitResult
from dispatcher.api.submission import parse_submission

__all__ = ["router"]

router = APIRouter()

_SUBMIT_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "required": ["type"],
                    "properties": {
                        "type": {"type": "string", "example": "sleep"},
                        "class": {"type": "string", "default": "batch"},
                        "args": {"type": "object", "default": {}},
                        "timeout_s": {"type": "number"},
                    },
                }
            },
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "type": {"type": "string", "default": "document.extract"},
                        "class": {"type": "string"},
                        "args": {"type": "string", "description": "JSON object"},
                        "timeout_s": {"type": "string"},
                    },
                }
            },
        },
    }
}


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


def _backpressure(depth: int, est: float | None, pressure: str) -> dict[str, str]:
    return {
        "Gpulane-Queue-Depth": str(depth),
        "Gpulane-Estimated-Wait": f"{est:.1f}" if est is not None else "-1",
        "Gpulane-Pressure": pressure,
    }


def _class_headers(state: ClassState) -> dict[str, str]:
    return _backpressure(state.depth, state.estimated_wait_s, state.pressure)


def _refusal(result: SubmitResult, state: ClassState, sub: Submission) -> ApiError:
    if result.verdict == "over_quota":
        retry = max(math.ceil(state.run_s), 1)  # about when one of its tasks ends
        return ApiError(
            429,
            "rate_limited",
            f"Tenant {sub.tenant!r} has {sub.max_in_flight} tasks queued or running, its "
            f"max_in_flight; retry in {retry} s.",
            headers={"Retry-After": str(retry)},
            retry_after_s=retry,
        )
    retry = admission.retry_after_s(result.depth, state.run_s, state.workers, state.config)
    headers = {
        **_backpressure(result.depth, result.estimated_wait_s, "full"),
        "Retry-After": str(retry),
    }
    if result.verdict == "no_workers":
        message = f"No live worker serves class {state.name!r}; retry later."
    elif result.limit == "bytes":
        message = (
            f"Class {state.name!r} is full: its unfinished tasks hold max_queued_bytes "
            f"({state.config.max_queued_bytes} bytes of uploads); retry in {retry} s."
        )
    else:
        message = f"Class {state.name!r} is full ({result.depth} queued); retry in {retry} s."
    return ApiError(503, result.verdict, message, headers=headers, retry_after_s=retry)


async def _submit(
    svc: Services, sub: Submission, snap: Snapshot
) -> tuple[SubmitResult, ClassState]:
    state = snap.classes[sub.cls]
    result = await svc.store.submit(sub, state)
    if result.verdict == "no_workers":
        # The cached snapshot may predate a worker that just registered: look again
        # before refusing (cheap: with no live worker for the class there is little to read).
        state = (await svc.pool.snapshot()).classes[sub.cls]
        result = await svc.store.submit(sub, state)
    return result, state


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
    sub = await parse_submission(request, principal, svc.settings, svc.catalog)
    add_headers(request, _class_headers(snap.classes[sub.cls]))
    result, state = await _submit(svc, sub, snap)
    if result.verdict == "idempotency_key_reused":
        raise ApiError(
            422,
            "idempotency_key_reused",
            f"This Idempotency-Key was first used for another request (task {result.task_id}); "
            "use a new key for a new request.",
        )
    if result.verdict in ("queue_full", "no_workers", "over_quota"):
        svc.recorder.count("rejected", sub.cls, result.verdict)
        raise _refusal(result, state, sub)
    body: dict[str, Any] = {
        "id": result.task_id,
        "status": result.status,
        "type": result.task_type,
        "class": result.cls,
        "position": None,
        "estimated_wait_s": None,
    }
    headers = {**extra_headers(request), "Location": f"/tasks/{result.task_id}"}
    if result.verdict == "duplicate":
        headers["Idempotent-Replayed"] = "true"
        return JSONResponse(body, status_code=200, headers=headers)
    svc.recorder.count("submitted", sub.cls, sub.task_type)
    est = result.estimated_wait_s
    body["position"] = result.depth - 1
    body["estimated_wait_s"] = round(est, 3) if est is not None else None
    pressure = admission.pressure(result.depth, state.run_s, state.workers, state.config)
    headers.update(_backpressure(result.depth, est, pressure))
    return JSONResponse(body, status_code=202, headers=headers)


def _not_found(task_id: str) -> ApiError:
    return ApiError(404, "not_found", f"No task {task_id[:64]!r}.")


@router.get(
    "/tasks/{task_id}",
    tags=["tasks"],
    responses={200: _RECORD, **error_responses(401, 404, 429, 503)},
    response_model=None,
)
async def get_task(task_id: str, request: Request) -> JSONResponse:
    """The task record: status, position, progress, result or error, timings."""
    svc = services(request)
    principal = await caller(request)
    record = await svc.store.get(task_id, principal.task_scope) if len(task_id) <= 64 else None
    if record is None:
        raise _not_found(task_id)
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
    result = await svc.store.cancel(task_id, principal.task_scope)
    if result.verdict == "not_found":
        raise _not_found(task_id)
    if result.verdict == "conflict":
        message = f"Task {task_id!r} already ended ({result.status})."
        raise ApiError(409, "conflict", message, status=result.status)
    if result.verdict == "canceled":  # no worker will report it
        svc.recorder.count("finished", result.cls, result.task_type, "canceled")
    record = await svc.store.get(task_id, principal.task_scope)
    status = 200 if result.verdict == "canceled" else 202
    return JSONResponse(record, status_code=status, headers=extra_headers(request))
