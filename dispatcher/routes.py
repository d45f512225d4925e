"""HTTP routes of API v1 (see ``shared/DESIGN.md`` for the contract)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from redis.asyncio import Redis
from redis.exceptions import RedisError

from dispatcher import admission
from dispatcher.auth import Authenticator, Principal
from dispatcher.catalog import Catalog
from dispatcher.errors import STORE_RETRY_AFTER_S, ApiError, error_body
from dispatcher.metrics import Recorder
from dispatcher.pool import NOT_SERVING, ClassState, Pool, Snapshot
from dispatcher.ratelimit import RateLimiter
from dispatcher.settings import Settings
from dispatcher.store import Submission, SubmitResult, TaskStore
from dispatcher.submission import parse_submission

__all__ = ["Services", "caller", "router", "services"]

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


@dataclass
class Services:
    settings: Settings
    client: Redis
    store: TaskStore
    pool: Pool
    catalog: Catalog
    auth: Authenticator
    limiter: RateLimiter
    recorder: Recorder


def services(request: Request) -> Services:
    services: Services = request.app.state.services
    return services


def _headers(request: Request) -> dict[str, str]:
    """Headers every response to this request carries, errors included."""
    headers: dict[str, str] = getattr(request.state, "extra_headers", {})
    return headers


def _add_headers(request: Request, headers: dict[str, str]) -> None:
    request.state.extra_headers = {**_headers(request), **headers}


async def caller(request: Request, response: Response | None = None) -> Principal:
    """Authenticate, then take one token from the tenant's rate limit (429 when empty)."""
    svc = services(request)
    principal = svc.auth.authenticate(request.headers.get("authorization"))
    if principal.config is not None:
        verdict = await svc.limiter.take(principal.config)
        _add_headers(request, verdict.headers())
        if response is not None:
            response.headers.update(verdict.headers())
        if not verdict.allowed:
            if request.method == "POST":
                svc.recorder.count("rejected", "-", "rate_limited")
            raise verdict.refusal()
    return principal


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


@router.post("/tasks", status_code=202, openapi_extra=_SUBMIT_BODY, tags=["tasks"])
async def submit_task(request: Request) -> JSONResponse:
    """Submit a task (JSON, or multipart with a `file`). 202 with its id and queue position."""
    svc = services(request)
    snap = await svc.pool.cached()
    _add_headers(request, _class_headers(snap.classes[svc.settings.default_class]))
    principal = await caller(request)
    sub = await parse_submission(request, principal, svc.settings, svc.catalog)
    _add_headers(request, _class_headers(snap.classes[sub.cls]))
    result, state = await _submit(svc, sub, snap)
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
    headers = {**_headers(request), "Location": f"/tasks/{result.task_id}"}
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


@router.get("/tasks/{task_id}", tags=["tasks"])
async def get_task(task_id: str, request: Request, response: Response) -> dict[str, Any]:
    """The task record: status, position, progress, result or error, timings."""
    svc = services(request)
    principal = await caller(request, response)
    record = await svc.store.get(task_id, principal.task_scope) if len(task_id) <= 64 else None
    if record is None:
        raise _not_found(task_id)
    return record


@router.delete("/tasks/{task_id}", tags=["tasks"])
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
    return JSONResponse(record, status_code=status, headers=_headers(request))


@router.get("/queues", tags=["pool"])
async def queues(request: Request, response: Response) -> dict[str, Any]:
    """Each class in priority order: depth, running, workers, waits and pressure."""
    svc = services(request)
    principal = await caller(request, response)
    snap = await svc.pool.snapshot()
    return {
        "classes": [
            state.to_json() for state in snap.classes.values() if principal.may_use(state.name)
        ]
    }


@router.get("/workers", tags=["pool"])
async def workers(request: Request, response: Response) -> dict[str, Any]:
    """Live workers with device, state and current task (admin keys only, when keys are set)."""
    svc = services(request)
    principal = await caller(request, response)
    if not principal.admin:
        raise ApiError(404, "not_found", "No route /workers for this key.")
    snap = await svc.pool.snapshot()
    return {"workers": snap.workers}


@router.get("/health", tags=["pool"])
async def health(request: Request, response: Response) -> dict[str, Any]:
    """200 while Redis answers, else 503."""
    svc = services(request)
    try:
        await svc.client.ping()
    except RedisError:
        response.status_code = 503
        response.headers["Retry-After"] = str(STORE_RETRY_AFTER_S)
        return {
            "status": "unavailable",
            "redis": "unreachable",
            "workers": None,
            **error_body("store_unavailable", "The task store (Redis) is unreachable."),
        }
    snap = svc.pool.latest
    workers = snap.workers if snap else []
    return {
        "status": "ok",
        "redis": "ok",
        "workers": len(workers),
        # Live workers able to take a task now (not starting, waiting for a GPU or
        # unhealthy): what a readiness check wants.
        "serving": sum(w["state"] not in NOT_SERVING for w in workers),
    }
