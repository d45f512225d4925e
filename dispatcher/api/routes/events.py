"""``GET /tasks/<id>/events``: a task's changes as Server-Sent Events.

One event per status or progress change, each carrying the whole task record as JSON
``data``: ``status`` (a new status, attempt or cancel request), ``progress`` (new
progress while running), and last ``final``, after which the stream closes. The first
event is the record as it is when the stream opens. A quiet stream carries a comment
line every ``events_keepalive_s``; a stream closes after ``events_max_s`` (the client
opens another) or when the record disappears. Auth, the rate limit and tenant
isolation are checked before the stream starts, so they answer as JSON errors.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from redis.exceptions import RedisError

from dispatcher.api.deps import caller, extra_headers, services
from dispatcher.api.errors import ApiError, error_responses
from dispatcher.api.waiters import Waiters

__all__ = ["router", "sse"]

router = APIRouter()
log = logging.getLogger("gpulane.api")

_RETRY_MS = 1000  # how soon an EventSource reconnects after the stream ends


def sse(kind: str, data: dict[str, Any] | None) -> bytes:
    """One event in text/event-stream framing; a keep-alive is a comment line."""
    if data is None:
        return b": keep-alive\n\n"
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


async def _stream(
    waiters: Waiters, task_id: str, scope: str | None, duration_s: float, keepalive_s: float
) -> AsyncIterator[bytes]:
    yield f"retry: {_RETRY_MS}\n\n".encode()
    events = waiters.follow(task_id, scope, duration_s, keepalive_s)
    try:
        async for kind, record in events:
            yield sse(kind, record)
    except RedisError as exc:  # the status line is long gone: end the stream, it reconnects
        log.warning("event stream of task %s ended: redis unavailable (%s)", task_id, exc)
    finally:
        await events.aclose()  # its watch goes now, not when collected


@router.get(
    "/tasks/{task_id}/events",
    tags=["tasks"],
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "The task's changes, then `final`.",
            "content": {"text/event-stream": {}},
        },
        **error_responses(401, 404, 429, 503),
    },
)
async def task_events(task_id: str, request: Request) -> StreamingResponse:
    """Server-Sent Events: `status`, `progress`, then `final` with the record; closes."""
    svc = services(request)
    principal = await caller(request)
    found = len(task_id) <= 64 and await svc.store.get(task_id, principal.task_scope)
    if not found:
        raise ApiError(404, "not_found", f"No task {task_id[:64]!r}.")
    settings = svc.settings
    body = _stream(
        svc.waiters,
        task_id,
        principal.task_scope,
        settings.events_max_s,
        settings.events_keepalive_s,
    )
    headers = {
        **extra_headers(request),
        "Cache-Control": "no-store",
        "X-Accel-Buffering": "no",  # proxies (nginx) pass events on at once
    }
    return StreamingResponse(body, media_type="text/event-stream", headers=headers)
