"""The API's error responses: ``{"error": "<code>", "message": "<one sentence>", ...}``.

Handlers raise :class:`ApiError`; the exception handlers here turn it, FastAPI's
validation errors, unknown routes and every Redis error into that shape. A traceback
or a bare 500 never reaches a client.

Redis errors, all ``503 store_unavailable`` with ``Retry-After``:

- unreachable, timing out or loading (``ConnectionError``, ``TimeoutError``,
  ``BusyLoadingError``): retry in 2 s;
- full (``OutOfMemoryError``: ``maxmemory`` reached with ``noeviction``): a write was
  refused whole before it ran (script flags, :mod:`dispatcher.contract.scripts`);
  retry in 5 s. Reads keep working;
- read-only (``ReadOnlyError``: a replica, e.g. after a failover): retry in 2 s;
- any other ``ResponseError`` (a script or command the server refused): a bug,
  logged with its traceback, and still a clean 503.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import PydanticCustomError
from redis.exceptions import (
    OutOfMemoryError,
    ReadOnlyError,
    RedisError,
)
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dispatcher.contract.connect import ReplicaLag, refused

__all__ = [
    "CHECK",
    "FULL_RETRY_AFTER_S",
    "STORE_RETRY_AFTER_S",
    "ApiError",
    "ErrorBody",
    "check",
    "error_body",
    "error_responses",
    "first_problem",
    "install_error_handlers",
    "store_error",
    "store_failure",
]

log = logging.getLogger("gpulane.api")

STORE_RETRY_AFTER_S = 2
FULL_RETRY_AFTER_S = 5
_MAX_TEXT = 300  # characters of any one message: a 422 never echoes a huge client value
# The error type of a request model's own checks (check()): their message is already
# the sentence the client gets, where pydantic's own messages get the field's name.
CHECK = "gpulane_check"


def check(message: str) -> PydanticCustomError:
    """What a request model's validator raises: ``message`` is the answer."""
    return PydanticCustomError(CHECK, message)


def first_problem(exc: ValidationError) -> tuple[str, str | None]:
    """A request model's first validation error as a sentence, and the field it is on
    (every route with a request model answers with it, in its own error shape)."""
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"])
    field = str(err["loc"][0]) if err["loc"] else None
    if err["type"] == CHECK:
        return err["msg"], field
    if err["type"] == "missing":
        return f"'{where}' is required.", field
    return (f"'{where}': {err['msg']}." if where else f"{err['msg']}."), field


class ErrorBody(BaseModel):
    """Every error's body; some codes add fields (``docs/design.md``, "Errors")."""

    model_config = ConfigDict(extra="allow")

    error: str
    message: str


_WHEN = {
    400: "Malformed request (body not JSON, bad multipart, bad Content-Length).",
    401: "Missing or unknown bearer key (only when keys are configured).",
    404: "No such task, another tenant's, or a route this key may not use.",
    409: "The task already ended.",
    413: "Body or file over its limit.",
    416: "A result's ?pages= range it does not hold (or a result not stored in parts).",
    422: "Invalid request (fields, args against the type's schema, Idempotency-Key).",
    429: "Tenant over its rate or max_in_flight.",
    503: "queue_full, no_workers, or store_unavailable (Redis unreachable, full, read-only).",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for these error statuses, each with the error body."""
    content = {"application/json": {"schema": ErrorBody.model_json_schema()}}
    return {status: {"description": _WHEN[status], "content": content} for status in statuses}


class ApiError(Exception):
    def __init__(
        self,
        http_status: int,
        code: str,
        message: str,
        headers: dict[str, str] | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(message)
        self.status = http_status
        self.code = code
        self.message = message
        self.headers = headers or {}
        self.extra = extra


def error_body(code: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"error": code, "message": message, **extra}


def _clip(value: Any) -> Any:
    """``value`` with every string cut to ``_MAX_TEXT`` characters (lists and dicts
    walked, at most 5 entries of a list): messages quote what the client sent."""
    if isinstance(value, str):
        return value if len(value) <= _MAX_TEXT else value[:_MAX_TEXT] + "..."
    if isinstance(value, list):
        return [_clip(v) for v in value[:5]]
    if isinstance(value, dict):
        return {k: _clip(v) for k, v in value.items()}
    return value


def _response(exc: ApiError, request: Request) -> JSONResponse:
    headers = {**getattr(request.state, "extra_headers", {}), **exc.headers}
    extra = {k: v if k == "known" else _clip(v) for k, v in exc.extra.items()}
    return JSONResponse(
        error_body(exc.code, _clip(exc.message), **extra), status_code=exc.status, headers=headers
    )


def store_error(exc: RedisError) -> ApiError:
    """The 503 for a Redis error (module docstring); logs what an operator must see."""
    retry = STORE_RETRY_AFTER_S
    if isinstance(exc, ReplicaLag):  # min_replica_acks: a submit not confirmed in time
        log.warning("submit not confirmed by replicas: %s", exc)
        message = (
            "The task store could not confirm the task on its replicas in time; "
            "resubmit with the same Idempotency-Key."
        )
    elif isinstance(exc, OutOfMemoryError):
        retry = FULL_RETRY_AFTER_S
        message = "The task store (Redis) is full (maxmemory); nothing was written. Retry later."
        log.warning("redis is full (maxmemory): a write was refused")
    elif isinstance(exc, ReadOnlyError):
        message = "The task store (Redis) is read-only (a replica?); retry shortly."
        log.warning("redis is read-only: %s", exc)
    elif refused(exc):
        message = "The task store refused the operation; it has been logged. Retry shortly."
        log.error("redis refused a command or script (a bug)", exc_info=exc)
    else:
        message = "The task store (Redis) is unreachable; retry shortly."
        log.warning("redis unavailable: %s", exc)
    return ApiError(503, "store_unavailable", message, headers={"Retry-After": str(retry)})


def store_failure(exc: RedisError, request: Request) -> ApiError:
    """The 503 for a store failure seen while answering ``request`` (a Redis error, or a
    submit its replicas did not confirm: ReplicaLag). A full Redis is remembered for
    GET /health."""
    if isinstance(exc, OutOfMemoryError):
        request.app.state.redis_full_at = time.monotonic()
    return store_error(exc)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _response(exc, request)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        details = [
            {"loc": list(err.get("loc", ())), "msg": err.get("msg", "")} for err in exc.errors()
        ]
        return _response(
            ApiError(
                422, "invalid_request", "The request does not match the API.", details=details
            ),
            request,
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        codes = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}
        code = codes.get(exc.status_code, "invalid_request")
        message = exc.detail if isinstance(exc.detail, str) else "Request refused."
        headers = dict(exc.headers or {})
        if exc.status_code == 404:
            message = f"No route {request.url.path}."
        if exc.status_code == 405:
            allow = _allowed(request)
            headers["Allow"] = ", ".join(sorted(allow))
            message = f"{request.method} is not allowed here; allowed: {headers['Allow']}."
        return _response(ApiError(exc.status_code, code, message, headers=headers), request)

    @app.exception_handler(RedisError)
    async def store_down(request: Request, exc: RedisError) -> JSONResponse:
        return _response(store_failure(exc, request), request)

    @app.exception_handler(ClientDisconnect)
    async def disconnected(request: Request, exc: ClientDisconnect) -> JSONResponse:
        # Nobody reads this answer: one short line, no traceback.
        log.info("client disconnected before its request was read: %s %s", *_where(request))
        return _response(ApiError(400, "invalid_request", "The client disconnected."), request)

    app.add_middleware(_Unexpected)
    app.add_middleware(HeadAsGet)


def _allowed(request: Request) -> set[str]:
    """Every method some route answers on this path (Starlette names only the first
    route that matched the path)."""
    allow = _methods(request.app.routes, request.scope)
    if "GET" in allow:
        allow.add("HEAD")  # HeadAsGet answers HEAD on every GET route
    return allow


def _methods(routes: Any, scope: Scope) -> set[str]:
    found: set[str] = set()
    for route in routes:
        methods = getattr(route, "methods", None)
        if methods:
            if route.matches(scope)[0] != Match.NONE:
                found |= set(methods)
        else:  # an included router (FastAPI wraps it)
            inner = getattr(route, "routes", None)
            if inner is None:
                inner = getattr(getattr(route, "original_router", None), "routes", ())
            found |= _methods(inner, scope)
    return found


def _where(request: Request) -> tuple[str, str]:
    return request.method, request.url.path[:200]


class HeadAsGet:
    """``HEAD`` on any ``GET`` route: run the ``GET`` and send its headers only (load
    balancers probe ``/health`` with ``HEAD``). FastAPI's routes answer only the methods
    they declare."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def headers_only(message: Message) -> None:
            if message["type"] == "http.response.body":
                if message.get("more_body", False):
                    return
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, headers_only)


class _Unexpected:
    """The last resort: an exception no handler took is logged once, with its traceback,
    and answered ``500 internal_error`` (Starlette's own handler would log it again
    through the server and re-raise)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception:
            request = Request(scope)
            log.exception("unhandled error on %s %s", *_where(request))
            if not started:
                error = ApiError(
                    500, "internal_error", "An unexpected error occurred; it has been logged."
                )
                await _response(error, request)(scope, receive, send)
