"""What the API and the backend workers agree on for work served by an inference
server (``docs/design.md`` §4 "Backend workers"): the task type a backend model is
published under, its arguments, the stream entry kinds and the token estimate.

A backend model is one task type, ``backend.<slug>``, routed: only the backend
workers that list it take its tasks (``claim.lua``). Its arguments say which of the
server's routes to call, with the OpenAI request body as the client sent it.
"""

from __future__ import annotations

import hashlib
import math
import re
from enum import StrEnum
from typing import Any

__all__ = [
    "ARGS_SCHEMA",
    "BACKEND_PREFIX",
    "Kind",
    "StreamEntry",
    "catalog_entry",
    "estimate_tokens",
    "type_of_model",
]

BACKEND_PREFIX = "backend."
_SLUG = re.compile(r"[^a-z0-9]+")


class Kind(StrEnum):
    """The server route a backend task calls."""

    CHAT = "chat"  # /v1/chat/completions
    COMPLETIONS = "completions"  # /v1/completions
    EMBEDDINGS = "embeddings"  # /v1/embeddings


class StreamEntry(StrEnum):
    """The ``k`` field of a ``gpulane:stream:<id>`` entry."""

    CHUNK = "chunk"  # d: one chunk as the backend streamed it
    END = "end"  # d: {usage, finish_reason}: the stream is whole
    ERROR = "error"  # d: {code, message}: the stream ends here, incomplete


ARGS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["kind", "body"],
    "additionalProperties": False,
    "properties": {
        "kind": {"type": "string", "enum": [k.value for k in Kind]},
        "body": {"type": "object", "description": "The OpenAI request body, sent as it is."},
        "stream": {"type": "boolean", "default": False},
    },
}


def type_of_model(model: str) -> str:
    """The task type a backend model is published under: readable and stable (the
    same model id on every backend is one type, so its tasks go to any of them), and
    unique (a digest of the id: two ids with one slug stay apart)."""
    slug = _SLUG.sub("_", model.lower()).strip("_")[:40] or "model"
    digest = hashlib.sha256(model.encode()).hexdigest()[:8]
    return f"{BACKEND_PREFIX}{slug}_{digest}"


def catalog_entry(model: str, context_length: int | None = None) -> dict[str, Any]:
    """The catalog entry a backend worker publishes for one of its server's models;
    ``context_length`` when the server says it (the API refuses a ``max_tokens`` past
    it)."""
    entry: dict[str, Any] = {
        "description": f"Model {model!r} on an OpenAI-compatible inference server.",
        "schema": ARGS_SCHEMA,
        "file": "none",
        "model": model,
        "backend": True,
    }
    if context_length:
        entry["context_length"] = context_length
    return entry


def _text_of(value: Any) -> int:
    """Characters of text in a prompt or message content (strings, lists of parts)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(_text_of(v) for v in value)
    if isinstance(value, dict):
        return _text_of(value.get("text", "")) + _text_of(value.get("content", ""))
    return 0


def estimate_tokens(kind: Kind, body: dict[str, Any]) -> int:
    """A prompt's tokens before any tokenizer has seen it: four characters a token
    (OpenAI's rule of thumb for English), at least one. Used to charge a tpm budget at
    admission (settled with the real count later) and where a backend streams no
    usage."""
    if kind is Kind.CHAT:
        chars = _text_of(body.get("messages", []))
    else:
        chars = _text_of(body.get("prompt", "")) + _text_of(body.get("input", ""))
    return max(math.ceil(chars / 4), 1)
