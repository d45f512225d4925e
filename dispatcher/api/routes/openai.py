"""OpenAI-compatible entry: ``GET /v1/models`` and ``POST /v1/embeddings``.

A call's inputs are one request of the model's task type (the catalog maps a model id
to the type that serves it), in the class ``openai_class``: packed into chunks of the
type's batch size (:mod:`dispatcher.api.bulk`), longest first (:func:`packing_order`),
and admitted as one unit sized in items, so admission, tenants, quotas, fairness and
dynamic batching apply as to ``POST /tasks``, and no input has a record of its own.
The route waits for every chunk through the process' task waiters (no polling), and
answers in OpenAI's shape. Tenant keys are the API keys (``Authorization: Bearer``).
Errors raised inside these routes use OpenAI's body, ``{"error": {"message", "type",
"param", "code"}}``, with the status the official SDK expects; the ``Retry-After`` and
rate-limit headers are kept.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
)
from redis.exceptions import RedisError
from starlette.background import BackgroundTask

from dispatcher.api import generation
from dispatcher.api.admit import admit
from dispatcher.api.auth import Principal
from dispatcher.api.bulk import Packer, fits_ever
from dispatcher.api.deps import Services, caller, extra_headers, services
from dispatcher.api.errors import ApiError, check, store_failure
from dispatcher.api.openai_shape import first_error
from dispatcher.api.openai_shape import invalid as _invalid
from dispatcher.api.openai_shape import openai_error as _openai_error
from dispatcher.api.openai_shape import responses as _errors
from dispatcher.api.store import Record, Submission
from dispatcher.api.submission import check_value, gpu_memory, limited_body
from dispatcher.api.waiters import unless_disconnected
from dispatcher.contract import vectors
from dispatcher.contract.generation import Kind
from dispatcher.contract.jobs import FINAL, ErrorCode, TaskStatus, chunk_item
from dispatcher.contract.strict_json import loads_strict

__all__ = ["router"]

log = logging.getLogger("gpulane.api")
router = APIRouter(prefix="/v1", tags=["openai"])

MAX_INPUTS = 2048
# A failed item's code -> the HTTP status of the whole request: the client's input
# (400), the pool losing the worker (503, worth a retry), or the model failing on it
# (502: the upstream, here the worker, failed).
_ITEM_STATUS: dict[str, int] = {
    ErrorCode.INVALID_ARGS: 400,
    ErrorCode.WORKER_LOST: 503,
    ErrorCode.GPU_FAULT: 503,
    ErrorCode.TIMEOUT: 503,
    ErrorCode.CANCELED: 503,
}


async def _models(svc: Services, wanted: str | None = None) -> dict[str, str]:
    """model id -> the task type that serves it, from the catalog the maintenance loop
    keeps fresh; read afresh only when ``wanted`` is missing (a worker that just came)."""
    models = svc.catalog.models()
    if wanted is None or wanted not in models:
        await svc.catalog.refresh()
        models = svc.catalog.models()
    return models


MODEL_EXAMPLE = "sentence-transformers/all-MiniLM-L6-v2"
_TEXT = {"type": "string", "minLength": 1}
_INPUT_SCHEMA = {  # GET /openapi.json narrows maxItems to what the class can queue
    "oneOf": [_TEXT, {"type": "array", "items": _TEXT, "minItems": 1, "maxItems": MAX_INPUTS}]
}


class EmbeddingsRequest(BaseModel):
    """An embeddings request, as OpenAI's API takes it (token arrays aside)."""

    # The one shape behind both the body's validation and its OpenAPI schema. `input`
    # is checked against `max_chars` (openai_max_input_chars), the validation context.

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(examples=[MODEL_EXAMPLE], description="A model id from GET /v1/models.")
    input: Annotated[list[str] | str, WithJsonSchema(_INPUT_SCHEMA)]
    encoding_format: vectors.EncodingFormat = vectors.FLOAT
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None

    @field_validator("dimensions", mode="before")
    @classmethod
    def _whole(cls, value: Any) -> Any:
        # JSON Schema's integer includes 200.0; a bool is no number here.
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, bool):
            raise check("'dimensions' must be a whole number, 1 or more.")
        return value

    @field_validator("input", mode="before")
    @classmethod
    def _texts(cls, value: Any, info: ValidationInfo) -> list[str]:
        max_chars = int((info.context or {}).get("max_chars", 8192))
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not items:
            raise check("'input' must be a non-empty string or list of strings.")
        if len(items) > MAX_INPUTS:
            raise check(f"'input' has {len(items)} items; at most {MAX_INPUTS}.")
        for i, item in enumerate(items):
            if not isinstance(item, str):
                raise check(f"'input[{i}]' must be a string (token arrays are not supported).")
            if not item:
                raise check(f"'input[{i}]' is empty.")
            if len(item) > max_chars:
                raise check(f"'input[{i}]' has {len(item)} characters; at most {max_chars}.")
        return items


@router.get(
    "/models",
    summary="Models served by the pool (OpenAI shape)",
    responses=_errors(401, 429, 503),
)
async def list_models(request: Request) -> JSONResponse:
    svc = services(request)
    try:
        await caller(request)
        models = await _models(svc)
    except ApiError as exc:
        return _openai_error(exc, request)
    except RedisError as exc:
        return _openai_error(store_failure(exc, request), request)
    data = [
        {"id": model, "object": "model", "created": 0, "owned_by": "gpulane"}
        for model in sorted(models)
    ]
    return JSONResponse({"object": "list", "data": data}, headers=extra_headers(request))


async def _body(request: Request, svc: Services) -> tuple[EmbeddingsRequest, dict[str, Any]]:
    """The request, validated, and its body as sent (what a backend server is given)."""
    raw = await limited_body(request, svc.settings.openai_max_body_bytes)
    try:
        body = loads_strict(raw)
        check_value(body)  # what POST /tasks refuses (lone surrogates, NaN, nesting)
    except (ValueError, RecursionError) as exc:
        raise _invalid(f"The body is not valid JSON: {str(exc)[:200]}.") from exc
    except ApiError as exc:
        raise _invalid(exc.message) from exc  # OpenAI's 400 invalid_request_error
    if not isinstance(body, dict):
        raise _invalid("The body must be a JSON object.")
    context = {"max_chars": svc.settings.openai_max_input_chars}
    try:
        return EmbeddingsRequest.model_validate(body, context=context), body
    except ValidationError as exc:
        raise first_error(exc) from None


def packing_order(texts: list[str], chunk: int) -> list[int]:
    """The inputs' indices in the order they are packed into chunks: longest first
    (in characters, as sentence-transformers sorts its batches) when they fill more
    than one chunk, ties in input order. A model pads a batch to its longest input,
    so chunks of like lengths spend little work on padding: one call of 2,048 texts of
    10-202 tokens ran at 0.42-0.50x in-process packed in input order, 0.95-1.00x
    packed by length (``bench embed_api``, its mixed row; 2 CPU cores, and on a GPU the
    padding is as much wasted work). Within one chunk the order is the model's own."""
    if len(texts) <= chunk:
        return list(range(len(texts)))
    return sorted(range(len(texts)), key=lambda i: -len(texts[i]))


async def _pack(
    svc: Services, principal: Principal, task_type: str, texts: list[str]
) -> tuple[Submission, list[Record], list[int]]:
    """The inputs as one request, checked: chunks of the type's batch size, packed in
    :func:`packing_order` (returned: the answer puts each back at its index), to be
    admitted whole or refused whole."""
    cls = svc.settings.openai_task_class
    if not principal.may_use(cls):
        message = f"This key may not use class {cls!r}, which serves /v1/embeddings."
        raise ApiError(403, "forbidden", message)
    timeout_s = svc.settings.class_timeout_s(cls)
    info = await svc.catalog.lookup(task_type)
    # A type declaring more GPU memory than any card has is a 422, as for POST /tasks.
    gpu_mb = gpu_memory(None, info.gpu_memory_mb if info else 0, svc.settings.max_gpu_memory_mb)
    chunk = info.chunk_size(svc.settings) if info else 1
    # Vectors asked for packed, whatever the client wants: a quarter of the bytes, and
    # passed through to a base64 client untouched (a handler may ignore it: lists).
    packer = Packer(encoding_format=vectors.BASE64)
    order = packing_order(texts, chunk)
    for i in order:
        packer.add(task_type, {"text": texts[i]}, timeout_s, gpu_mb, chunk)
    records, _ = packer.done()
    sub = Submission(
        task_type,
        cls,
        {},
        timeout_s,
        principal.tenant,
        gpu_memory_mb=gpu_mb,
        routed=bool(info and info.backend),
        **principal.terms(),
    )
    try:
        fits_ever(len(texts), len(records), sub, svc.settings)
    except ApiError as exc:  # no retry could fit it: OpenAI's 400 on `input`
        raise _invalid(f"'input': {exc.message}", "input") from None
    return sub, records, order


async def _cancel(svc: Services, ids: list[str], principal: Principal) -> None:
    """Best effort: tasks nobody will read (final ones are left as they are)."""
    results = await asyncio.gather(
        *(svc.store.cancel(i, principal.task_scope) for i in ids), return_exceptions=True
    )
    for result in results:
        if not isinstance(result, BaseException) and result.verdict == "canceled":
            svc.recorder.count("finished", result.cls, result.task_type, "canceled", n=result.items)


async def _let_go(svc: Services, ids: list[str]) -> None:
    """Once a 200 went out, the records it was read from (every vector is in it) are
    kept only ``openai_result_ttl_s`` more, not the whole ``result_ttl_s``: nobody reads
    them again, and a chunk of 64 vectors is ~130 KB of Redis. A call that failed keeps
    them for whoever looks into it. Best effort: a Redis error leaves them to expire as
    before."""
    try:
        await svc.store.retain(ids, svc.settings.openai_result_ttl_s)
    except RedisError as exc:
        log.warning("could not shorten the retention of %d records: %s", len(ids), exc)


def _item_error(record: dict[str, Any], index: int) -> ApiError:
    error = record.get("error") or {}
    code = str(error.get("code", "task_error"))
    message = f"input[{index}]: {error.get('message', 'failed')}"
    status = _ITEM_STATUS.get(code, 502)
    if status == 400:
        return ApiError(400, "invalid_request", message, param="input")
    headers = {"Retry-After": "1"} if status == 503 else {}
    return ApiError(status, code, message, headers=headers)


def _bad_result(index: int, exc: Exception) -> ApiError:
    """A task that succeeded with no usable embedding: the model's fault (502)."""
    why = f"{type(exc).__name__}: {exc}"[:200]
    message = f"input[{index}]: the task's result holds no embedding ({why})."
    return ApiError(502, ErrorCode.INVALID_RESULT, message)


def _items(records: list[dict[str, Any] | None], order: list[int]) -> list[dict[str, Any]]:
    """Each input's record, in input order: a task's own, or its item of a chunk
    (the records hold them in ``order``, see :func:`packing_order`)."""
    packed: list[dict[str, Any]] = []
    for record in records:
        assert record is not None  # the caller checked every one is final
        count = record.get("items")
        packed.extend((chunk_item(record, k) for k in range(count)) if count else [record])
    items: list[dict[str, Any]] = [{}] * len(order)
    for index, item in zip(order, packed, strict=True):
        items[index] = item
    return items


def _encode(vector: Any, fmt: str) -> tuple[list[float] | str, int]:
    """A task's vector as OpenAI sends it (floats, or base64 of little-endian float32)
    and its dimensions; VectorError for anything else. Packed (``embed`` packs what
    /v1/embeddings asks for): passed through to a base64 client as it is (its length
    checked), unpacked for a float client. A list (a type that ignores the request's
    encoding_format): its numbers checked as float32 values."""
    if isinstance(vector, str):
        if fmt == vectors.BASE64:
            return vector, vectors.dimensions(vector)
        values = vectors.unpack(vector)
        return values, len(values)
    if not isinstance(vector, list):
        raise vectors.VectorError(f"the embedding is a {type(vector).__name__}")
    if fmt == vectors.BASE64:
        return vectors.pack_floats(vector), len(vector)
    vectors.check_floats(vector)  # what packing would refuse, a float client is not sent
    return vector, len(vector)


@router.post(
    "/embeddings",
    summary="Embeddings (OpenAI shape)",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": EmbeddingsRequest.model_json_schema()}},
        }
    },
    responses=_errors(400, 401, 403, 404, 413, 429, 499, 502, 503, 504),
)
async def embeddings(request: Request) -> Response:
    """One task per input, in class `openai_class`; answers when all have ended."""
    try:
        return await _embeddings(request)
    except ApiError as exc:
        return _openai_error(exc, request)
    except RedisError as exc:  # the same 503 as every route, OpenAI's body
        return _openai_error(store_failure(exc, request), request)


async def _embeddings(request: Request) -> Response:
    svc = services(request)
    principal = await caller(request)
    req, body = await _body(request, svc)
    model = req.model  # ("" names no model: the 404 below)
    models = await _models(svc, model)
    if model not in models:
        name = str(model)[:100]
        raise ApiError(404, "model_not_found", f"The model {name!r} does not exist.")
    info = await svc.catalog.lookup(models[model])
    if info is not None and info.backend:  # an embedding server behind a backend worker
        gen = await generation.submit(
            svc, principal, info, Kind.EMBEDDINGS, body, svc.settings.openai_task_class
        )
        relayed = await generation.whole(svc, request.receive, gen, principal.task_scope)
        headers = {**extra_headers(request), "Gpulane-Task-Id": gen.task_id}
        return Response(
            relayed,
            media_type="application/json",
            headers=headers,
            background=BackgroundTask(_let_go, svc, [gen.task_id]),
        )
    texts = req.input if isinstance(req.input, list) else [req.input]
    dimensions, fmt = req.dimensions, req.encoding_format
    sub, packed, order = await _pack(svc, principal, models[model], texts)
    ids = [r.task_id for r in packed]
    scope, timeout_s = principal.task_scope, svc.settings.openai_timeout_s
    # Watched before they exist: each record's first read is its final one.
    with svc.waiters.watch_all(ids) as watches:
        await admit(svc, sub, packed)
        work = asyncio.gather(
            *(svc.waiters.wait_final(w, scope, timeout_s, unread=False) for w in watches)
        )
        try:
            records = await unless_disconnected(request.receive, work)
        except RedisError:
            await _cancel(svc, ids, principal)
            raise
    if records is None:  # the client left: its tasks would only burn GPU time
        await _cancel(svc, ids, principal)
        raise ApiError(499, "client_closed", "The client closed the request.")
    if any(record is None or record["status"] not in FINAL for record in records):
        await _cancel(svc, ids, principal)  # every unfinished one, not only the first
        raise ApiError(504, "timeout", "The embeddings did not finish in time.")
    data: list[dict[str, Any]] = []
    tokens = 0
    for index, item in enumerate(_items(records, order)):
        if item["status"] != TaskStatus.SUCCEEDED:
            raise _item_error(item, index)
        result = item["result"]
        try:
            embedding, gives = _encode(result["embedding"], fmt)
            tokens += int(result.get("tokens", 0))
        except (KeyError, TypeError, AttributeError, ValueError) as exc:  # VectorError too
            raise _bad_result(index, exc) from None
        if dimensions is not None and dimensions != gives:
            raise _invalid(
                f"The model {model!r} gives {gives} dimensions and cannot give "
                f"{dimensions}; leave 'dimensions' out.",
                "dimensions",
            )
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    answer = {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    # orjson: 2,048 vectors of floats are megabytes the json module writes slowly.
    return Response(
        orjson.dumps(answer),
        media_type="application/json",
        headers=extra_headers(request),
        background=BackgroundTask(_let_go, svc, ids),  # after the answer went: off its path
    )
