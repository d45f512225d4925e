"""The API's error responses: ``{"error": "<code>", "message": "<one sentence>", ...}``.

Handlers raise :class:`ApiError`; the exception handlers here turn it, FastAPI's
validation errors, unknown routes and Redis outages into that shape. A traceback or a
bare 500 never reaches a client.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dispatcher.api.store import NotReplicated
from dispatcher.contract.connect import OUTAGE

__all__ = ["STORE_RETRY_AFTER_S", "ApiError", "error_body", "install_error_handlers"]

log = logging.getLogger("gpulane.api")

STORE_RETRY_AFTER_S = 2
_STORE_DOWN = OUTAGE  # a failover in progress included (READONLY, MASTERDOWN)


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


def _response(exc: ApiError, request: Request) -> JSONResponse:
    headers = {**getattr(request.state, "extra_headers", {}), **exc.headers}
    return JSONResponse(
        error_body(exc.code, exc.message, **exc.extra), status_code=exc.status, headers=headers
    )


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
        if exc.status_code == 404:
            message = f"No route {request.url.path}."
        return _response(ApiError(exc.status_code, code, message), request)

    @app.exception_handler(NotReplicated)
    async def not_replicated(request: Request, exc: Exception) -> JSONResponse:
        log.warning("submit not confirmed by replicas: %s", exc)
        return _response(
            ApiError(
                503,
                "store_unavailable",
                "The task store could not confirm the task on its replicas in time; "
                "resubmit with the same Idempotency-Key.",
                headers={"Retry-After": str(STORE_RETRY_AFTER_S)},
            ),
            request,
        )

    for kind in _STORE_DOWN:

        @app.exception_handler(kind)
        async def store_down(request: Request, exc: Exception) -> JSONResponse:
            log.warning("redis unavailable: %s", exc)
            return _response(
                ApiError(
                    503,
                    "store_unavailable",
                    "The task store (Redis) is unreachable; retry shortly.",
                    headers={"Retry-After": str(STORE_RETRY_AFTER_S)},
                ),
                request,
            )

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return _response(
            ApiError(500, "internal_error", "An unexpected error occurred; it has been logged."),
            request,
        )
