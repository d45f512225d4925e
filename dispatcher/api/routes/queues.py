"""``GET /queues`` (every class the caller may use) and ``GET /workers``
(live workers; admin keys only when keys are configured)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response

from dispatcher.api.deps import caller, services
from dispatcher.api.errors import ApiError, error_responses

__all__ = ["router"]

router = APIRouter()


@router.get("/queues", tags=["pool"], responses=error_responses(401, 429, 503))
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


@router.get("/workers", tags=["pool"], responses=error_responses(401, 404, 429, 503))
async def workers(request: Request, response: Response) -> dict[str, Any]:
    """Live workers with device, state and current task (admin keys only, when keys are set)."""
    svc = services(request)
    principal = await caller(request, response)
    if not principal.admin:
        raise ApiError(404, "not_found", "No route /workers for this key.")
    snap = await svc.pool.snapshot()
    return {"workers": snap.workers}
