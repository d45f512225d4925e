"""Turning a ``POST /tasks`` request into a validated :class:`Submission`.

Two shapes are accepted: a JSON body, a task as
:class:`~dispatcher.api.task_request.TaskRequest` takes it (``{"type", "class", "args",
"timeout_s", "gpu_memory_mb"}``), and ``multipart/form-data`` with a ``file`` part plus
the same fields as optional text parts (``args`` a JSON string), read into JSON values
and checked by the same model. Sizes are enforced while reading: a declared
``Content-Length`` over the limit is refused before a byte is read, and a body that
streams past it is cut off, so an oversized upload never sits in memory.
Uploads are spooled to disk by the multipart parser past 1 MiB.
"""

from __future__ import annotations

import re
from typing import Any

from python_multipart.multipart import parse_options_header
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request
from starlette.types import Message, Receive

from dispatcher.api.auth import Principal
from dispatcher.api.errors import ApiError
from dispatcher.api.store import Submission
from dispatcher.api.task_request import FIELDS, TaskRequest, task_request
from dispatcher.api.task_types import Catalog, TaskTypeInfo
from dispatcher.contract.jobs import FileMeta
from dispatcher.contract.settings import Settings
from dispatcher.contract.strict_json import NonFinite, loads_strict, number

__all__ = [
    "check_value",
    "content_type",
    "gpu_memory",
    "json_body",
    "limited_body",
    "parse_submission",
    "submission_of",
    "too_large",
]

_MAX_DEPTH = 32  # nesting of arrays and objects in a request
_MAX_IDEMPOTENCY_KEY = 255
_MAX_FILENAME = 255
_WHOLE = re.compile(r"[0-9]{1,12}")


def too_large(limit: int, what: str) -> ApiError:
    return ApiError(
        413,
        "payload_too_large",
        f"The {what} is larger than the limit of {limit} bytes.",
        limit_bytes=limit,
    )


def _limited(request: Request, limit: int, what: str) -> Request:
    """The same request, its body cut off with a 413 once it passes ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise too_large(limit, what)
        except ValueError as exc:
            raise ApiError(400, "invalid_request", "Content-Length is not a number.") from exc
    seen = 0
    upstream: Receive = request.receive

    async def receive() -> Message:
        nonlocal seen
        message = await upstream()
        seen += len(message.get("body", b""))
        if seen > limit:
            raise too_large(limit, what)
        return message

    return Request(request.scope, receive)


async def json_body(request: Request, settings: Settings, json_lines: bool) -> bytes:
    """A JSON (or JSON Lines) body under its limit: ``bulk_max_body_bytes`` for a bulk
    (JSON Lines, or an array: known from its first character), else ``max_body_bytes``,
    refused with 413 as soon as the stream passes it."""
    single, bulk = settings.max_body_bytes, settings.bulk_max_body_bytes
    limit = bulk
    decided = json_lines
    chunks: list[bytes] = []
    seen = 0
    async for chunk in _limited(request, bulk, "request body").stream():
        chunks.append(chunk)
        seen += len(chunk)
        if not decided and (head := b"".join(chunks).lstrip()[:1]):
            decided, limit = True, bulk if head == b"[" else single
        if seen > limit:
            raise too_large(limit, "request body")
    return b"".join(chunks)


async def limited_body(request: Request, limit: int) -> bytes:
    """The whole body, refused with 413 as soon as it passes ``limit`` bytes."""
    return await _limited(request, limit, "request body").body()


def _invalid(message: str, **extra: Any) -> ApiError:
    return ApiError(422, "invalid_request", message, **extra)


def check_value(value: Any, where: str = "body", depth: int = 0) -> None:
    """Refuse (422) what cannot round-trip through Redis, the worker and the record:
    nesting past ``_MAX_DEPTH``, NaN or infinities, strings (keys included) that are
    not valid Unicode (lone surrogates)."""
    if depth > _MAX_DEPTH:
        raise _invalid(f"The request nests deeper than {_MAX_DEPTH} levels ({where}).")
    if isinstance(value, NonFinite):
        raise _invalid(f"{value.text} is not a JSON number ({where}).")
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError as exc:
            raise _invalid(f"A string is not valid Unicode (a lone surrogate?) ({where}).") from exc
    elif isinstance(value, list):
        for item in value:
            check_value(item, where, depth + 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            check_value(key, where, depth + 1)
            check_value(item, f"{where}.{key}"[:80] if depth == 0 else where, depth + 1)


def json_fields(body: bytes, settings: Settings) -> dict[str, Any]:
    """A single task's JSON body (already read), checked."""
    if len(body) > settings.max_body_bytes:
        raise too_large(settings.max_body_bytes, "request body")
    try:
        fields = loads_strict(body)
    except (ValueError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
        raise ApiError(400, "invalid_request", f"The body is not valid JSON: {exc}.") from exc
    if not isinstance(fields, dict):
        raise ApiError(400, "invalid_request", "The body must be a JSON object.")
    return fields


class _FormParser(MultiPartParser):
    """Starlette's parser, except that a ``file`` part sent without a file name is
    still a file (its bytes, not text decoded as UTF-8 or latin-1)."""

    def on_headers_finished(self) -> None:
        part = self._current_part
        _, options = parse_options_header(part.content_disposition)
        if options.get(b"name") == b"file" and b"filename" not in options:
            part.content_disposition = (part.content_disposition or b"") + b'; filename=""'
        super().on_headers_finished()


async def _form_fields(
    request: Request, settings: Settings
) -> tuple[dict[str, Any], UploadFile | None]:
    limited = _limited(request, settings.max_file_bytes + settings.max_body_bytes, "upload")
    try:
        parser = _FormParser(
            limited.headers,
            limited.stream(),
            max_files=1,
            max_fields=8,
            max_part_size=settings.max_body_bytes,
        )
        form = await parser.parse()
    except MultiPartException as exc:
        raise ApiError(400, "invalid_request", f"Malformed multipart body: {exc.message}") from exc
    fields: dict[str, Any] = {}
    upload: UploadFile | None = None
    for name, value in form.multi_items():
        if name in fields or (name == "file" and upload is not None):
            raise _invalid(f"The form part {name!r} is given twice.")  # which one counts?
        if name == "file" and isinstance(value, UploadFile):
            upload = value
        elif name in FIELDS and isinstance(value, str):
            fields[name] = value
        else:
            raise _invalid(f"Unexpected form part {name!r}; parts are 'file' and {sorted(FIELDS)}.")
    if "args" in fields:
        try:
            fields["args"] = loads_strict(fields["args"])
        except (ValueError, RecursionError) as exc:
            raise _invalid(f"The 'args' part is not valid JSON: {exc}.") from exc
    if "timeout_s" in fields:
        try:
            fields["timeout_s"] = number(fields["timeout_s"].strip())
        except ValueError as exc:
            raise _invalid("The 'timeout_s' part is not a number.") from exc
    if "gpu_memory_mb" in fields:
        text = fields["gpu_memory_mb"].strip()  # ASCII digits only: int() takes others
        fields["gpu_memory_mb"] = int(text) if _WHOLE.fullmatch(text) else text
    return fields, upload


def gpu_memory(asked: int | None, declared: int, max_mb: int) -> int:
    """GPU memory the task needs (MB): what the request asked (checked against
    ``max_gpu_memory_mb`` by its model), else what its type declares, which no card
    may fall short of."""
    if asked is not None:
        return asked
    if declared > max_mb:  # a type declaring more than any card has
        raise _invalid(f"The type declares {declared} MB of GPU memory; no card has it.")
    return declared


def content_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


async def _read(request: Request, settings: Settings) -> tuple[dict[str, Any], UploadFile | None]:
    if content_type(request) == "application/json":
        body = await _limited(request, settings.max_body_bytes, "request body").body()
        return json_fields(body, settings), None
    if content_type(request) == "multipart/form-data":
        return await _form_fields(request, settings)
    raise ApiError(
        400, "invalid_request", "Send application/json, or multipart/form-data with a 'file' part."
    )


def _class(req: TaskRequest, principal: Principal, settings: Settings) -> str:
    cls = req.class_ or settings.default_class
    if cls not in settings.classes or not principal.may_use(cls):
        known = [c for c in settings.class_names if principal.may_use(c)]
        raise ApiError(422, "unknown_class", f"Unknown class {cls!r}.", known=known)
    return cls


async def _task_type(
    req: TaskRequest, upload: UploadFile | None, settings: Settings, catalog: Catalog
) -> TaskTypeInfo:
    task_type = req.type or (settings.default_file_task if upload else None)
    if task_type is None:
        raise _invalid("The 'type' field is required.")
    info = await catalog.lookup(task_type)
    if info is None:
        raise ApiError(
            422,
            "unknown_task_type",
            f"Unknown task type {task_type!r}.",
            known=await catalog.names(),
        )
    problems = info.errors(req.args)
    if problems:
        raise _invalid(f"Invalid arguments for {task_type!r}: {problems[0]}", details=problems)
    if info.file == "required" and upload is None:
        raise _invalid(f"Task type {task_type!r} needs a document: send it as the 'file' part.")
    if info.file == "none" and upload is not None:
        raise _invalid(f"Task type {task_type!r} does not take a file.")
    return info


async def _upload(upload: UploadFile | None, limit: int) -> tuple[FileMeta | None, bytes]:
    if upload is None:
        return None, b""
    if upload.size is not None and upload.size > limit:
        raise too_large(limit, "file")
    data = await upload.read()
    await upload.close()  # our parser's spooled file (request.form() would close it)
    if len(data) > limit:
        raise too_large(limit, "file")
    if not data:
        raise _invalid("The file is empty.")
    name = (upload.filename or "upload")[:_MAX_FILENAME]
    return FileMeta(name, upload.content_type or "application/octet-stream", len(data)), data


def _idempotency_key(request: Request) -> str | None:
    key = request.headers.get("idempotency-key")
    if key is not None and not 0 < len(key) <= _MAX_IDEMPOTENCY_KEY:
        raise _invalid(f"Idempotency-Key must have 1 to {_MAX_IDEMPOTENCY_KEY} characters.")
    return key


async def parse_submission(
    request: Request,
    principal: Principal,
    settings: Settings,
    catalog: Catalog,
    body: bytes | None = None,
) -> Submission:
    """Read and validate a submission; raise :class:`ApiError` with a clear message.
    ``body``: a JSON body the caller has read already."""
    if body is not None:
        fields, upload = json_fields(body, settings), None
    else:
        fields, upload = await _read(request, settings)
    return await submission_of(fields, principal, settings, catalog, upload, request)


async def submission_of(
    fields: Any,
    principal: Principal,
    settings: Settings,
    catalog: Catalog,
    upload: UploadFile | None = None,
    request: Request | None = None,
) -> Submission:
    """Validate a task's fields (a JSON value: a body, a bulk's task, a form's parts) and
    its upload; the request gives its headers."""
    check_value(fields)
    req = task_request(fields, settings)
    cls = _class(req, principal, settings)
    info = await _task_type(req, upload, settings, catalog)
    gpu_memory_mb = gpu_memory(req.gpu_memory_mb, info.gpu_memory_mb, settings.max_gpu_memory_mb)
    meta, data = await _upload(upload, settings.max_file_bytes)
    return Submission(
        task_type=info.name,
        cls=cls,
        args=req.args,
        timeout_s=req.timeout_s or settings.class_timeout_s(cls),
        tenant=principal.tenant,
        file=meta,
        file_data=data,
        idempotency_key=_idempotency_key(request) if request is not None else None,
        gpu_memory_mb=gpu_memory_mb,
        gpu_memory_asked=req.gpu_memory_mb,
        routed=info.backend,
        **principal.terms(),
    )
