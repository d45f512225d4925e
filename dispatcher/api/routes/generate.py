"""OpenAI-compatible generation: ``POST /v1/chat/completions`` and
``POST /v1/completions``, streamed or whole, served by backend workers.

Thin over :mod:`dispatcher.api.generation`: validate the body (one pydantic model per
shape, which is also its OpenAPI schema), admit it as one task, answer with the
server's own JSON or relay its stream as server-sent events. Errors use OpenAI's body.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from redis.exceptions import RedisError

from dispatcher.api import generation
from dispatcher.api.deps import Services, caller, extra_headers, services
from dispatcher.api.errors import ApiError, store_failure
from dispatcher.api.openai_shape import first_error, invalid, openai_error, responses
from dispatcher.api.submission import check_value, limited_body
from dispatcher.contract.generation import BACKEND_PREFIX, Kind
from dispatcher.contract.strict_json import loads_strict

__all__ = ["router", "stream_router"]

router = APIRouter(prefix="/v1", tags=["openai"])
stream_router = APIRouter(tags=["tasks"])

_ERRORS = (400, 401, 403, 404, 413, 429, 499, 502, 503, 504)


class _Request(BaseModel):
    # Every other OpenAI field (temperature, stop, seed, tools...) goes to the server
    # as the client sent it: the server knows what it supports.
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1, max_length=256, examples=["tiny-llama"])
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    max_tokens: int | None = Field(None, ge=1)


class ChatRequest(_Request):
    messages: list[dict[str, Any]] = Field(min_length=1, max_length=4096)
    max_completion_tokens: int | None = Field(None, ge=1)


class CompletionRequest(_Request):
    prompt: str | list[str] = Field(examples=["Once upon a time"])


async def _body(request: Request, svc: Services, shape: type[_Request]) -> dict[str, Any]:
    raw = await limited_body(request, svc.settings.generation_max_body_bytes)
    try:
        body = loads_strict(raw)
        check_value(body)
    except (ValueError, RecursionError) as exc:
        raise invalid(f"The body is not valid JSON: {str(exc)[:200]}.") from exc
    except ApiError as exc:
        raise invalid(exc.message) from exc
    if not isinstance(body, dict):
        raise invalid("The body must be a JSON object.")
    try:
        shape.model_validate(body)
    except ValidationError as exc:
        raise first_error(exc) from None
    return body  # as sent: validated, not rewritten


async def _generate(request: Request, kind: Kind, shape: type[_Request]) -> Response:
    svc = services(request)
    principal = await caller(request)
    body = await _body(request, svc, shape)
    info = await generation.backend_model(svc, body.get("model"), kind)
    gen = await generation.submit(
        svc, principal, info, kind, body, request.headers.get(generation.CLASS_HEADER)
    )
    headers = {**extra_headers(request), "Gpulane-Task-Id": gen.task_id}
    scope = principal.task_scope
    if not body.get("stream"):
        answer = await generation.whole(svc, request.receive, gen, scope)
        return Response(answer, media_type="application/json", headers=headers)
    first = await generation.until(
        svc, request.receive, gen.task_id, generation.first_entry(svc, gen, scope)
    )
    return StreamingResponse(
        _relay(svc, gen, scope, first),
        media_type="text/event-stream",
        headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _relay(svc: Services, gen: generation.Generation, scope: str | None, first: Any) -> Any:
    """The stream; a client gone mid-stream (the response is cancelled) cancels the
    task, which closes the backend worker's connection to its server."""
    done = False
    try:
        async for part in generation.read_stream(svc, gen, scope, first):
            yield part
        done = True
    finally:
        if not done:
            # The response is being cancelled (the client left): shielded, or this
            # await would be cancelled with it and the task run on for nobody.
            with anyio.CancelScope(shield=True):
                await generation.cancel(svc, gen.task_id)


async def _in_openai_shape(request: Request, work: Awaitable[Response]) -> Response:
    """``work``'s response, or its error in OpenAI's body."""
    try:
        return await work
    except ApiError as exc:
        return openai_error(exc, request)
    except RedisError as exc:
        return openai_error(store_failure(exc, request), request)


@router.post(
    "/chat/completions",
    summary="Chat completions (OpenAI shape), streamed or whole, by a backend worker",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": ChatRequest.model_json_schema()}},
        }
    },
    responses=responses(*_ERRORS),
)
async def chat_completions(request: Request) -> Response:
    return await _in_openai_shape(request, _generate(request, Kind.CHAT, ChatRequest))


@router.post(
    "/completions",
    summary="Text completions (OpenAI shape), streamed or whole, by a backend worker",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": CompletionRequest.model_json_schema()}},
        }
    },
    responses=responses(*_ERRORS),
)
async def completions(request: Request) -> Response:
    return await _in_openai_shape(request, _generate(request, Kind.COMPLETIONS, CompletionRequest))


@stream_router.get(
    "/tasks/{task_id}/stream",
    summary="A generation's stream, from any API process (server-sent events)",
    responses=responses(401, 404, 409, 429, 502, 503, 504),
)
async def task_stream(request: Request, task_id: str) -> Response:
    """The chunks of a backend task submitted with ``stream: true`` (by ``POST /tasks``
    or the OpenAI routes, on this process or another), as the OpenAI routes send them,
    usage chunk included; ``data: [DONE]`` at its end. A task that is not a streamed
    generation is `409 not_a_stream`."""
    return await _in_openai_shape(request, _task_stream(request, task_id))


async def _task_stream(request: Request, task_id: str) -> Response:
    svc = services(request)
    principal = await caller(request)
    scope = principal.task_scope
    record = await svc.store.get(task_id, scope)
    if record is None:
        raise ApiError(404, "not_found", f"No task {task_id[:100]!r}.")
    if not str(record.get("type", "")).startswith(BACKEND_PREFIX):
        raise generation.not_a_stream(task_id)
    gen = generation.Generation(task_id, "", Kind.CHAT, True, 0)
    first = await generation.until(
        svc, request.receive, task_id, generation.first_entry(svc, gen, scope)
    )
    return StreamingResponse(
        generation.read_stream(svc, gen, scope, first),
        media_type="text/event-stream",
        headers={**extra_headers(request), "Cache-Control": "no-cache"},
    )
