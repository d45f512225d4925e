"""OpenAI's shapes for what every OpenAI-compatible route answers on error: the body
``{"error": {"message", "type", "param", "code"}}`` with the status the official SDK
expects, the same for the OpenAPI schema, and a request model's validation error as
that body (each route's pydantic model serves both its validation and its schema)."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from dispatcher.api.deps import extra_headers
from dispatcher.api.errors import ApiError, first_problem

__all__ = ["first_error", "invalid", "openai_error", "responses"]


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, "invalid_request", message, param=param)


def first_error(exc: ValidationError) -> ApiError:
    """A request model's first validation error as OpenAI's 400, ``param`` its field."""
    message, param = first_problem(exc)
    return invalid(message, param)


# gpulane error code -> OpenAI's error type.
_TYPES = {
    "unauthorized": "authentication_error",
    "rate_limited": "rate_limit_exceeded",
    "model_not_found": "invalid_request_error",
    "invalid_request": "invalid_request_error",
    "payload_too_large": "invalid_request_error",
    "forbidden": "permission_error",
}


def openai_error(exc: ApiError, request: Request) -> JSONResponse:
    param = exc.extra.get("param")
    body = {
        "error": {
            "message": exc.message,
            "type": _TYPES.get(exc.code, "server_error"),
            "param": param if isinstance(param, str) else None,
            "code": exc.code,
        }
    }
    headers = {**extra_headers(request), **exc.headers}
    return JSONResponse(body, status_code=exc.status, headers=headers)


_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": "string"},
            },
        }
    },
}


def responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI responses for these statuses, with OpenAI's error body."""
    content = {"application/json": {"schema": _ERROR}}
    return {
        s: {"description": "An error, in OpenAI's shape.", "content": content} for s in statuses
    }
