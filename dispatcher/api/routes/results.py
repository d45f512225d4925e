"""``GET /tasks/{id}/result``: a succeeded task's result on its own, streamed when it
is stored in parts (a task split into parts, ``dispatcher/api/parts.py``), whole or as
a range of entries (``?pages=1-100``)."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from dispatcher.api import parts
from dispatcher.api.deps import caller, extra_headers, services
from dispatcher.api.errors import ApiError, error_responses
from dispatcher.contract.jobs import TaskStatus
from dispatcher.contract.parts import RANGE_PATTERN, BackwardRange, EntryRange, parse_range

__all__ = ["router"]

router = APIRouter()

_PAGES_DOC = (
    "Only these entries of the merged list, numbered as the task numbers them (its pages, "
    "for document.extract): `7` or `1-100`. Only for a task split into parts."
)
_RESULT = {
    "description": "The result (JSON), streamed part by part for a task split into parts.",
    "content": {"application/json": {"schema": {}}},
}


@router.get(
    "/tasks/{task_id}/result",
    tags=["tasks"],
    responses={200: _RESULT, **error_responses(400, 401, 404, 409, 416, 422, 429, 503)},
    response_model=None,
)
async def task_result(
    task_id: str,
    request: Request,
    pages: str | None = Query(
        None, description=_PAGES_DOC, json_schema_extra={"pattern": RANGE_PATTERN}
    ),
) -> Response:
    """The result of a succeeded task, whole or (`?pages=`) a range of its entries."""
    svc = services(request)
    principal = await caller(request)
    wanted = _range(pages)
    record = None
    if len(task_id) <= 64:
        record = await svc.store.get(task_id, principal.task_scope, whole=False)
    if record is None:
        raise ApiError(404, "not_found", f"No task {task_id[:64]!r}.")
    if record["status"] != TaskStatus.SUCCEEDED:
        message = f"Task {task_id!r} is {record['status']}: only a succeeded task has a result."
        raise ApiError(409, "conflict", message, status=record["status"])
    headers = extra_headers(request)
    split = record["parts"]
    if split is None:
        if wanted is not None:
            message = f"Task {task_id!r} did not split into parts; read its result whole."
            raise ApiError(416, "range_not_satisfiable", message)
        # A task's record holds its result; a part's is read from its parent's parts.
        whole = await parts.complete(svc.client, record, svc.settings.max_result_bytes)
        return JSONResponse(whole["result"], headers=headers)
    shape = await parts.layout(svc.client, task_id, split["count"])
    body = await parts.stream(svc.client, record, shape, wanted)
    return StreamingResponse(body, media_type="application/json", headers=headers)


def _range(pages: str | None) -> EntryRange | None:
    if pages is None:
        return None
    try:
        return parse_range(pages)
    except BackwardRange as exc:
        raise ApiError(416, "range_not_satisfiable", f"pages: {exc}.") from exc
    except ValueError as exc:
        raise ApiError(422, "invalid_request", f"pages: {exc}.") from exc
