"""Generation through backend workers: admit a chat or completion request as one task
of its model's routed type, then read its answer, whole or as a stream.

A request is a task like any other (admission, tenants, quotas, fair share, classes),
of the type its backend workers publish for the model (``docs/design.md`` §4
"Backend workers"). A tenant's ``tpm`` budget is charged the request's ``max_tokens``
plus its prompt's estimate at admission (``tokens.lua``); the backend worker settles
it with the real usage. A stream is read from ``gpulane:stream:<id>``, which the
backend worker fills, so any API process can serve it; a client that leaves cancels
the task, which closes the worker's connection to its server.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import orjson
from redis.exceptions import RedisError
from starlette.types import Receive

from dispatcher.api.admit import admit
from dispatcher.api.auth import Principal
from dispatcher.api.deps import Services
from dispatcher.api.errors import ApiError
from dispatcher.api.refusals import over_limit
from dispatcher.api.store import Record, Submission
from dispatcher.api.task_types import TaskTypeInfo
from dispatcher.api.waiters import unless_disconnected
from dispatcher.contract import keys
from dispatcher.contract.generation import Kind, StreamEntry, estimate_tokens
from dispatcher.contract.jobs import FINAL, ErrorCode, TaskStatus, encode_call
from dispatcher.contract.scripts import options

__all__ = [
    "CLASS_HEADER",
    "Generation",
    "backend_model",
    "cancel",
    "check_context",
    "error_of",
    "first_entry",
    "not_a_stream",
    "read_stream",
    "submit",
    "until",
    "whole",
]

CLASS_HEADER = "x-gpulane-class"
T = TypeVar("T")
_READ_BLOCK_MS = 1000  # an XREAD waits this long before the record is looked at
_READ_COUNT = 512


@dataclasses.dataclass(frozen=True)
class Generation:
    """An admitted request: its task, and what its answer needs."""

    task_id: str
    model: str
    kind: Kind
    include_usage: bool
    created: int


async def backend_model(svc: Services, model: Any, kind: Kind) -> TaskTypeInfo:
    """The routed type serving ``model``: 404 ``model_not_found`` when none is known, 400
    when the model is served in-process (an embedding model has no chat)."""
    if not isinstance(model, str) or not model:
        message = "'model' is required: an id from GET /v1/models."
        raise ApiError(400, "invalid_request", message, param="model")
    types = svc.catalog.models()
    if model not in types:
        await svc.catalog.refresh()
        types = svc.catalog.models()
    info = await svc.catalog.lookup(types[model]) if model in types else None
    if info is None:
        raise ApiError(404, "model_not_found", f"The model {model[:100]!r} does not exist.")
    if not info.backend:
        raise ApiError(
            400,
            "invalid_request",
            f"The model {model!r} runs in-process: it serves /v1/embeddings, not {kind.value}.",
            param="model",
        )
    return info


def check_context(info: TaskTypeInfo, body: dict[str, Any]) -> None:
    """A ``max_tokens`` past the model's context (when its server said it) is a 400:
    no prompt would leave room for it."""
    for name in ("max_tokens", "max_completion_tokens"):
        asked = body.get(name)
        if info.context_length and isinstance(asked, int) and asked > info.context_length:
            raise ApiError(
                400,
                "invalid_request",
                f"'{name}' is {asked}; the model {info.model!r} has a context of "
                f"{info.context_length} tokens.",
                param=name,
            )


def _class_of(svc: Services, principal: Principal, header: str | None) -> str:
    cls = header or (principal.config.generation_class if principal.config else None)
    cls = cls or svc.settings.generation_task_class
    if cls not in svc.settings.classes:
        known = svc.settings.class_names
        raise ApiError(400, "invalid_request", f"Unknown class {cls[:40]!r}; configured: {known}.")
    if not principal.may_use(cls):
        raise ApiError(403, "forbidden", f"This key may not use class {cls!r}.")
    return cls


def _charge(kind: Kind, body: dict[str, Any], default_max: int) -> int:
    """What a tpm budget is charged at admission: the completion's ceiling (max_tokens,
    else max_completion_tokens, else ``default_max_tokens``) and the prompt's estimate."""
    ceiling = body.get("max_tokens") or body.get("max_completion_tokens") or default_max
    ceiling = ceiling if isinstance(ceiling, int) and ceiling > 0 else default_max
    return ceiling + (estimate_tokens(kind, body) if kind is not Kind.EMBEDDINGS else 0)


async def _take_tokens(svc: Services, principal: Principal, n: int) -> int:
    """Charge the tenant's tpm budget (0 without one); 429 when it cannot take ``n``."""
    tpm = principal.config.tpm if principal.config else None
    if tpm is None:
        return 0
    opts = options(op="take", tenant=principal.tenant, tpm=tpm, n=n)
    allowed, value = await svc.store.scripts.run("tokens", opts)
    if int(allowed):
        return n
    retry = max(math.ceil(int(value) / 1000), 1)
    svc.recorder.count("rejected", "-", "over_tpm")
    raise over_limit(
        f"Tenant {principal.tenant!r} is over its budget of {tpm} tokens a minute "
        f"(this request is charged {n}); retry in {retry} s.",
        retry,
    )


async def submit(
    svc: Services,
    principal: Principal,
    info: TaskTypeInfo,
    kind: Kind,
    body: dict[str, Any],
    cls_asked: str | None,
) -> Generation:
    """Admit the request as one task of the model's type (in class ``cls_asked``, else
    the tenant's or the settings' generation class), or raise its refusal."""
    check_context(info, body)
    cls = _class_of(svc, principal, cls_asked)
    stream = bool(body.get("stream"))
    args = {"kind": kind.value, "body": body, "stream": stream}
    timeout_s = svc.settings.generation_timeout_s
    sub = Submission(
        info.name,
        cls,
        args,
        timeout_s,
        principal.tenant,
        routed=True,
        **principal.terms(),
    )
    charge = _charge(kind, body, svc.settings.default_max_tokens)
    charged = await _take_tokens(svc, principal, charge)
    record = Record(info.name, encode_call(info.name, args), timeout_s, routed=True, tpm=charged)
    try:
        await admit(svc, sub, [record])
    except (RedisError, ApiError):  # refused: its charge goes back
        await _give_back(svc, principal, charged)
        raise
    options_ = body.get("stream_options")
    usage = isinstance(options_, dict) and options_.get("include_usage") is True
    return Generation(record.task_id, str(body["model"]), kind, usage, int(time.time()))


async def _give_back(svc: Services, principal: Principal, charged: int) -> None:
    if charged:
        opts = options(op="give", tenant=principal.tenant, n=charged)
        await svc.store.scripts.run("tokens", opts)


async def until(svc: Services, receive: Receive, task_id: str, work: Awaitable[T]) -> T:
    """``work``'s result; a client that leaves first cancels the task (499)."""
    try:
        result = await unless_disconnected(receive, work)
    except RedisError:
        await cancel(svc, task_id)
        raise
    if result is None:
        await cancel(svc, task_id)
        raise ApiError(499, "client_closed", "The client closed the request.")
    return result


async def cancel(svc: Services, task_id: str) -> None:
    """Best effort: a generation nobody will read (its timeout bounds it otherwise)."""
    try:
        result = await svc.store.cancel(task_id, None)
    except RedisError:
        return
    if result.verdict == "canceled":
        svc.recorder.count("finished", result.cls, result.task_type, "canceled")


async def whole(svc: Services, receive: Receive, gen: Generation, scope: str | None) -> bytes:
    """A generation's whole answer (the server's JSON), once its task ended well; its
    error otherwise (504 when it did not end in time, the task canceled)."""
    timeout_s = svc.settings.generation_timeout_s + svc.settings.wait_max_s
    record = await until(
        svc, receive, gen.task_id, svc.waiters.until_final(gen.task_id, scope, timeout_s)
    )
    if record is None or record["status"] not in FINAL:
        await cancel(svc, gen.task_id)
        raise ApiError(504, "timeout", "The generation did not finish in time.")
    if record["status"] != TaskStatus.SUCCEEDED:
        raise error_of(record)
    return orjson.dumps(record["result"])


def not_a_stream(task_id: str) -> ApiError:
    message = f"Task {task_id[:100]!r} is not a streamed generation; GET /tasks/{{id}} has it."
    return ApiError(409, "not_a_stream", message)


def error_of(record: dict[str, Any] | None) -> ApiError:
    """The HTTP error for a generation that did not succeed: the server's own 4xx for
    what it refused (a prompt past its context), 502 for its other failures, 504 for a
    timeout, 503 (worth a retry) when the pool lost the task."""
    if record is None:
        message = "The task's record is gone."
        return ApiError(503, "worker_lost", message, headers={"Retry-After": "1"})
    error = record.get("error") or {}
    code = str(error.get("code", ErrorCode.TASK_ERROR))
    message = str(error.get("message", "failed"))
    status = error.get("status")
    refused = isinstance(status, int) and 400 <= status < 500 and status != 429
    if code == ErrorCode.BACKEND_ERROR and refused:
        assert isinstance(status, int)
        return ApiError(400 if status == 422 else status, "invalid_request", message)
    if code == ErrorCode.TIMEOUT:
        return ApiError(504, "timeout", message)
    if code in (ErrorCode.WORKER_LOST, ErrorCode.CANCELED):
        return ApiError(503, code, message, headers={"Retry-After": "1"})
    return ApiError(502, code, message)


async def first_entry(svc: Services, gen: Generation, scope: str | None) -> tuple[bytes, list[Any]]:
    """Wait for the stream's first entries (or the task's end without any: the error it
    ended with is raised, so the client gets a real status rather than a broken 200)."""
    last = b"0-0"
    while True:
        entries = await _read(svc, gen.task_id, last)
        if entries and entries[0][1][b"k"] == StreamEntry.ERROR.encode():
            raise error_of({"error": orjson.loads(entries[0][1][b"d"])})
        if entries:
            return entries[-1][0], entries
        record = await svc.store.get(gen.task_id, scope)
        if record is None or record["status"] in FINAL:
            entries = await _read(svc, gen.task_id, last, block=False)
            if entries:
                return entries[-1][0], entries
            if record is not None and record["status"] == TaskStatus.SUCCEEDED:
                raise not_a_stream(gen.task_id)  # a whole answer: its result has it
            raise error_of(record)


async def _read(svc: Services, task_id: str, last: bytes, block: bool = True) -> list[Any]:
    key = keys.stream(task_id)
    wait_ms = _READ_BLOCK_MS if block else None
    reply: Any = await svc.client.xread({key: last}, count=_READ_COUNT, block=wait_ms)
    entries: list[Any] = reply[0][1] if reply else []  # RESP2: [[key, [(id, fields)]]]
    return entries


async def read_stream(
    svc: Services, gen: Generation, scope: str | None, first: tuple[bytes, list[Any]]
) -> AsyncIterator[bytes]:
    """The SSE body: each chunk as the server sent it, then ``data: [DONE]``; an error
    entry (or the task ending without its stream) as an ``error`` event."""
    last, entries = first
    events = _Events(gen)
    while True:
        parts = []
        over = False
        for _, fields in entries:
            part, over = events.event(fields[b"k"].decode(), fields[b"d"])
            parts.append(part)
            if over:
                break
        if parts:  # what one read brought goes out in one write
            yield b"".join(parts)
        if over:
            return
        entries = await _read(svc, gen.task_id, last)
        if entries:
            last = entries[-1][0]
            continue
        record = await svc.store.get(gen.task_id, scope)
        failed = record is None or (
            record["status"] in FINAL and record["status"] != TaskStatus.SUCCEEDED
        )
        if failed:
            entries = await _read(svc, gen.task_id, last, block=False)
            if not entries:  # ended without writing its end: say so, never hang
                error = error_of(record)
                yield _sse({"error": _stream_error({"code": error.code, "message": error.message})})
                return
            last = entries[-1][0]


def _sse(value: Any) -> bytes:
    return b"data: " + orjson.dumps(value) + b"\n\n"


class _Events:
    """Turns stream entries into SSE events for one client."""

    def __init__(self, gen: Generation) -> None:
        self.gen = gen
        self.usage_sent = False

    def event(self, kind: str, data: bytes) -> tuple[bytes, bool]:
        """The event for one entry (b"": none) and whether the stream is over."""
        if kind == StreamEntry.CHUNK:
            if b'"usage"' not in data:  # most chunks: passed on unparsed
                return b"data: " + data + b"\n\n", False
            chunk = orjson.loads(data)
            if chunk.get("usage"):
                if self.gen.include_usage:
                    self.usage_sent = True
                elif not chunk.get("choices"):
                    return b"", False  # the usage chunk gpulane asked for, not the client
                else:
                    chunk.pop("usage", None)
                data = orjson.dumps(chunk)
            return b"data: " + data + b"\n\n", False
        if kind == StreamEntry.END:
            end = orjson.loads(data)
            out = b""
            if self.gen.include_usage and not self.usage_sent:
                out = _sse(_usage_chunk(self.gen, end.get("usage")))
            return out + b"data: [DONE]\n\n", True
        return _sse({"error": _stream_error(orjson.loads(data))}), True


def _usage_chunk(gen: Generation, usage: Any) -> dict[str, Any]:
    """The last chunk OpenAI sends with ``include_usage``, for a server that sent none
    (its completion tokens counted by the worker, its prompt estimated)."""
    obj = "chat.completion.chunk" if gen.kind is Kind.CHAT else "text_completion"
    return {
        "id": f"gpulane-{gen.task_id}",
        "object": obj,
        "created": gen.created,
        "model": gen.model,
        "choices": [],
        "usage": usage,
    }


def _stream_error(error: dict[str, Any]) -> dict[str, Any]:
    return {
        "message": str(error.get("message", "The stream failed.")),
        "type": "server_error",
        "param": None,
        "code": str(error.get("code", "backend_error")),
    }
