"""The shape of a task in ``POST /tasks``: one pydantic model, :class:`TaskRequest`,
behind both the validation and the OpenAPI schema.

It checks a JSON body, each task of a bulk submit, and the parts sent beside a file
(their text read as JSON values first: :mod:`dispatcher.api.submission`). What only the
deployment knows arrives as validation context (``max_timeout_s``,
``max_gpu_memory_mb``); what needs the catalog or the caller's key (the type exists,
its ``args`` schema, the class is allowed) is checked after, by ``submission_of``.
``GET /openapi.json`` narrows the model's schema per task type (``api/openapi.py``).
Each check words its own message: a client reads which field and what is allowed.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from dispatcher.api.errors import ApiError, check, first_problem
from dispatcher.contract.settings import Settings

__all__ = ["FIELDS", "TaskRequest", "json_schema", "task_request", "upload_schema"]

MAX_NAME = 64


class TaskRequest(BaseModel):
    """A task: its type, class, arguments, timeout and GPU memory."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: str | None = Field(
        None, examples=["sleep"], description="A task type of the catalog (GET /openapi.json)."
    )
    class_: str | None = Field(None, alias="class", description="null or absent: default_class.")
    args: dict[str, Any] = Field(
        default_factory=dict, description="The type's arguments (its schema); absent: {}."
    )
    timeout_s: float | None = Field(
        None, gt=0, description="Seconds; null or absent: the class's default."
    )
    gpu_memory_mb: int | None = Field(
        None, ge=0, description="GPU memory the task needs, MB; null or absent: its type's"
    )

    @field_validator("type", "class_", mode="before")
    @classmethod
    def _name(cls, value: Any, info: ValidationInfo) -> str | None:
        if value is not None and (not isinstance(value, str) or not 0 < len(value) <= MAX_NAME):
            key = "class" if info.field_name == "class_" else info.field_name
            raise check(
                f"The '{key}' field must be a non-empty string of at most {MAX_NAME} characters."
            )
        return value

    @field_validator("args", mode="before")
    @classmethod
    def _args(cls, value: Any) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise check("'args' must be a JSON object.")
        return value

    @field_validator("timeout_s", mode="before")
    @classmethod
    def _timeout(cls, value: Any, info: ValidationInfo) -> float | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise check("'timeout_s' must be a number of seconds.")
        max_s = float((info.context or {}).get("max_timeout_s", math.inf))
        # An int is compared as it is: math.isfinite() or float() overflow on a huge one.
        if (isinstance(value, float) and not math.isfinite(value)) or not 0 < value <= max_s:
            raise check(f"'timeout_s' must be more than 0 and at most {max_s:g}.")
        return float(value)

    @field_validator("gpu_memory_mb", mode="before")
    @classmethod
    def _gpu_memory(cls, value: Any, info: ValidationInfo) -> int | None:
        if value is None:
            return None
        if isinstance(value, float) and value.is_integer():  # 1200.0 is 1200 (JSON Schema too)
            value = int(value)
        max_mb = int((info.context or {}).get("max_gpu_memory_mb", 0))
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= max_mb:
            raise check(
                f"'gpu_memory_mb' must be a whole number of MB from 0 to {max_mb} "
                "(max_gpu_memory_mb)."
            )
        return value


FIELDS = frozenset(f.alias or name for name, f in TaskRequest.model_fields.items())


def json_schema() -> dict[str, Any]:
    """The JSON body's schema: the model's, ``type`` required (beside no file)."""
    return {**TaskRequest.model_json_schema(by_alias=True), "required": ["type"]}


def upload_schema() -> dict[str, Any]:
    """The multipart body's schema: a ``file`` part and the model's fields as text parts
    (``args`` a JSON object as text)."""
    parts = {name: {"type": "string"} for name in sorted(FIELDS)}
    return {
        "type": "object",
        "required": ["file"],
        "additionalProperties": False,
        "properties": {"file": {"type": "string", "format": "binary"}, **parts},
    }


def task_request(value: Any, settings: Settings) -> TaskRequest:
    """``value`` (a task's JSON) as a :class:`TaskRequest`; 422 ``invalid_request``
    naming the first problem otherwise (every unknown field at once)."""
    if not isinstance(value, dict):
        raise ApiError(400, "invalid_request", "A task must be a JSON object.")
    unknown = sorted(set(value) - FIELDS)
    if unknown:
        message = f"Unknown fields {unknown[:5]}; a task has {sorted(FIELDS)}."
        raise ApiError(422, "invalid_request", message)
    context = {
        "max_timeout_s": settings.max_timeout_s,
        "max_gpu_memory_mb": settings.max_gpu_memory_mb,
    }
    try:
        return TaskRequest.model_validate(value, context=context)
    except ValidationError as exc:
        raise ApiError(422, "invalid_request", first_problem(exc)[0]) from None
