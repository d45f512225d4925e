"""The OpenAPI document: FastAPI's, completed with what only the running deployment
knows, so a client generator or schemathesis can rely on it.

- ``POST /tasks`` bodies list the task types of the catalog (one ``oneOf`` branch
  each, its ``args`` schema as the workers published it), the configured classes and
  the ``timeout_s`` range. JSON bodies name the types that take no required file;
  multipart bodies the types that take a file.
- ``POST /v1/embeddings`` bodies hold at most as many inputs as its class queues.
- With keys configured, the ``bearer`` security scheme, on every operation that needs
  a key (all but ``/health`` and the dashboard).

Re-read on every request of ``/openapi.json`` (the catalog changes as workers register).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from dispatcher.api.task_request import TaskRequest
from dispatcher.api.task_types import TaskTypeInfo
from dispatcher.contract.settings import Settings

__all__ = ["install_openapi"]

_PUBLIC = {"/", "/health"}  # no key needed even when keys are configured


def _json_branch(info: TaskTypeInfo, settings: Settings) -> dict[str, Any]:
    """The task model's schema, narrowed to ``info``'s type, its args and the limits."""
    schema = TaskRequest.model_json_schema(by_alias=True)
    props = schema["properties"]
    args = _args(info)
    props["type"] = {"const": info.name, "description": info.description}
    props["class"] = _class(settings)
    props["args"] = args
    props["timeout_s"]["anyOf"][0]["maximum"] = settings.max_timeout_s
    props["gpu_memory_mb"]["anyOf"][0]["maximum"] = settings.max_gpu_memory_mb
    props["gpu_memory_mb"]["description"] += f" ({info.gpu_memory_mb} MB)."
    # A type whose args have required fields needs `args` (absent means {}).
    schema["required"] = ["type", "args"] if args.get("required") else ["type"]
    return schema


def _file_branch(info: TaskTypeInfo, settings: Settings) -> dict[str, Any]:
    # `args` (a JSON object as text), `timeout_s` and `gpu_memory_mb` parts are accepted
    # too (docs/design.md §3); they are left out here because a schema cannot say "text
    # holding JSON valid against X" or "digits for a number up to max_gpu_memory_mb",
    # and a looser one would call requests valid that the API refuses.
    default = info.name == settings.default_file_task  # the type of a file sent alone
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["file"] if default else ["file", "type"],
        "properties": {
            "file": {"type": "string", "format": "binary", "minLength": 1},
            "type": {"const": info.name, "description": info.description},
            "class": {"enum": settings.class_names, "default": settings.default_class},
        },
    }


def _class(settings: Settings) -> dict[str, Any]:
    return {
        "enum": [*settings.class_names, None],
        "default": settings.default_class,
        "description": "null or absent: default_class.",
    }


def _args(info: TaskTypeInfo) -> dict[str, Any]:
    schema = dict(info.validator.schema) if isinstance(info.validator.schema, dict) else {}
    if not schema or "$defs" in schema or "definitions" in schema:
        return {"type": "object"}  # references would not resolve inside the document
    schema.pop("title", None)
    return schema


def _submit_body(
    operation: dict[str, Any], types: dict[str, TaskTypeInfo], settings: Settings
) -> None:
    content = operation.get("requestBody", {}).get("content", {})
    json_types = [t for t in types.values() if t.file != "required"]
    file_types = [t for t in types.values() if t.file != "none"]
    if json_types and "application/json" in content:
        content["application/json"]["schema"] = {
            "oneOf": [_json_branch(t, settings) for t in json_types]
        }
    if file_types and "multipart/form-data" in content:
        content["multipart/form-data"]["schema"] = {
            "oneOf": [_file_branch(t, settings) for t in file_types]
        }


def _embeddings_body(operation: dict[str, Any], settings: Settings) -> None:
    """``input`` holds no more items than the class ``/v1/embeddings`` submits to ever
    queues (a longer list is refused, 400, however long the client waits), each of at
    most ``openai_max_input_chars``."""
    body = operation["requestBody"]["content"]["application/json"]["schema"]
    room = settings.classes[settings.openai_task_class].max_queued
    longest = {"maxLength": settings.openai_max_input_chars}
    for branch in body["properties"]["input"]["oneOf"]:
        if branch.get("type") == "array":
            branch["maxItems"] = min(branch["maxItems"], room)
            branch["items"] = {**branch["items"], **longest}
        else:
            branch.update(longest)


def _secure(schema: dict[str, Any]) -> None:
    schema.setdefault("components", {})["securitySchemes"] = {
        "bearer": {"type": "http", "scheme": "bearer", "description": "API key"}
    }
    for path, operations in schema["paths"].items():
        if path not in _PUBLIC:
            for operation in operations.values():
                operation["security"] = [{"bearer": []}]


def install_openapi(
    app: FastAPI, settings: Settings, types: Callable[[], dict[str, TaskTypeInfo]]
) -> None:
    build = app.openapi

    def openapi() -> dict[str, Any]:
        schema = copy.deepcopy(build())  # FastAPI's, built once and cached
        submit = schema["paths"].get("/tasks", {}).get("post")
        if submit is not None:
            _submit_body(submit, types(), settings)
        embeddings = schema["paths"].get("/v1/embeddings", {}).get("post")
        if embeddings is not None:
            _embeddings_body(embeddings, settings)
        if settings.tenants:
            _secure(schema)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
