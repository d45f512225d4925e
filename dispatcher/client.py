"""Python clients for the gpulane API: :class:`Client` (sync) and :class:`AsyncClient`.

::

    with Client("http://127.0.0.1:8000") as gl:
        task = gl.submit("sleep", {"seconds": 2}, cls="interactive")
        done = gl.wait(task["id"])      # long-polls: returns the moment it ends

Both honour backpressure: a ``429`` or ``503`` is retried after its ``Retry-After``
(plus jitter, at most ``max_retries`` times); a submit carries an ``Idempotency-Key``
so a retry never creates a second task. Errors raise :class:`GpulaneError` subclasses
carrying the server's ``error`` code.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx

from dispatcher.contract.jobs import FINAL

__all__ = [
    "FINAL",
    "AsyncClient",
    "Client",
    "GpulaneError",
    "NotFound",
    "Overloaded",
    "Unauthorized",
]

FileArg = str | Path | bytes | IO[bytes]


class GpulaneError(Exception):
    """The API refused a request; ``code`` is its ``error`` field."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        body: dict[str, Any] | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.body = body or {}
        self.retry_after_s = retry_after_s


class NotFound(GpulaneError):
    pass


class Unauthorized(GpulaneError):
    pass


class Overloaded(GpulaneError):
    """429 or 503 still refused after the retries; ``retry_after_s`` says when to come back."""


@dataclass(frozen=True)
class _Request:
    method: str
    path: str
    json: dict[str, Any] | None = None
    data: dict[str, str] | None = None
    files: dict[str, tuple[str, bytes, str]] | None = None
    headers: dict[str, str] | None = None
    timeout_s: float | None = None  # None: the client's own


def _submit_request(
    task_type: str | None,
    args: dict[str, Any] | None,
    cls: str | None,
    file: FileArg | None,
    filename: str | None,
    timeout_s: float | None,
    idempotency_key: str | None,
) -> _Request:
    headers = {"Idempotency-Key": idempotency_key or str(uuid.uuid4())}
    if file is None:
        if task_type is None:
            raise ValueError("submit needs a task type or a file")
        body: dict[str, Any] = {"type": task_type, "args": args or {}}
        if cls:
            body["class"] = cls
        if timeout_s is not None:
            body["timeout_s"] = timeout_s
        return _Request("POST", "/tasks", json=body, headers=headers)
    if isinstance(file, str | Path):
        filename = filename or Path(file).name
        content = Path(file).read_bytes()
    elif isinstance(file, bytes):
        content = file
    else:
        content = file.read()
    form = {k: v for k, v in (("type", task_type), ("class", cls)) if v}
    if args:
        form["args"] = json.dumps(args)
    if timeout_s is not None:
        form["timeout_s"] = str(timeout_s)
    files = {"file": (filename or "document", content, "application/octet-stream")}
    return _Request("POST", "/tasks", data=form, files=files, headers=headers)


def _result_request(task_id: str, pages: str | None) -> _Request:
    query = f"?pages={pages}" if pages is not None else ""
    return _Request("GET", f"/tasks/{task_id}/result{query}", timeout_s=300.0)


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    try:
        return max(float(value), 0.0) if value is not None else None
    except ValueError:
        return None


def _error(response: httpx.Response) -> GpulaneError:
    try:
        body = response.json()
    except ValueError:
        body = {}
    code = str(body.get("error", "http_error"))
    message = str(body.get("message", response.text[:200]))
    kind: type[GpulaneError] = GpulaneError
    if response.status_code == 404:
        kind = NotFound
    elif response.status_code == 401:
        kind = Unauthorized
    elif response.status_code in (429, 503):
        kind = Overloaded
    return kind(response.status_code, code, message, body, _retry_after(response))


def _delay(attempt: int, response: httpx.Response | None, max_delay_s: float) -> float:
    """Wait before retry number ``attempt``: the server's Retry-After, else backoff."""
    hint = _retry_after(response) if response is not None else None
    base = hint if hint is not None else min(0.5 * 2**attempt, max_delay_s)
    return min(base, max_delay_s) + random.uniform(0, 0.1 + base * 0.1)  # noqa: S311


_LONG_POLL_SLACK_S = 10.0  # on top of a long-poll's wait, for the answer to arrive


def _long_poll(task_id: str, wait_s: float, deadline: float | None) -> tuple[_Request, float]:
    """``GET /tasks/<id>?wait=N`` for the next step of :meth:`Client.wait`, and its N."""
    n = wait_s if deadline is None else max(min(wait_s, deadline - time.monotonic()), 0.0)
    req = _Request("GET", f"/tasks/{task_id}?wait={n:.3f}", timeout_s=n + _LONG_POLL_SLACK_S)
    return req, n


def _early(started: float, n: float) -> float:
    """Seconds to pause when a long-poll came back unfinished well before its N (a
    server without ``?wait``): then the client polls every 0.5 s, not in a tight loop."""
    return 0.5 if time.monotonic() - started < n / 2 else 0.0


def _timed_out(task_id: str, record: dict[str, Any], timeout_s: float | None) -> TimeoutError:
    return TimeoutError(f"task {task_id} still {record['status']} after {timeout_s} s")


def _retryable(response: httpx.Response) -> bool:
    return response.status_code in (429, 503)


class _Base:
    def __init__(self, url: str, api_key: str | None, max_retries: int, max_delay_s: float) -> None:
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.max_retries = max_retries
        self.max_delay_s = max_delay_s

    def _kwargs(self, req: _Request) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "json": req.json,
            "data": req.data,
            "files": req.files,
            "headers": {**self.headers, **(req.headers or {})},
        }
        if req.timeout_s is not None:
            kwargs["timeout"] = req.timeout_s
        return kwargs

    def _retry_in(self, attempt: int, response: httpx.Response | None) -> float | None:
        """Seconds to wait before trying again, or None to stop here. A transport error
        (``response`` None) or a 429/503 is retried while attempts remain."""
        if attempt >= self.max_retries or (response is not None and not _retryable(response)):
            return None
        return _delay(attempt, response, self.max_delay_s)

    def _value(self, response: httpx.Response | None) -> Any:
        if response is None:
            raise httpx.ConnectError(f"cannot reach {self.url} (after {self.max_retries} retries)")
        if response.status_code >= 400:
            raise _error(response)
        return response.json()


class Client(_Base):
    """Blocking client (``httpx.Client`` underneath)."""

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        *,
        timeout_s: float = 30.0,
        max_retries: int = 5,
        max_delay_s: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        super().__init__(url, api_key, max_retries, max_delay_s)
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s, transport=transport)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _send(self, req: _Request) -> dict[str, Any]:
        result: dict[str, Any] = self._send_any(req)
        return result

    def _send_any(self, req: _Request) -> Any:
        attempt = 0
        while True:
            try:
                response = self._http.request(req.method, req.path, **self._kwargs(req))
            except httpx.TransportError:
                response = None
            delay = self._retry_in(attempt, response)
            if delay is None:
                return self._value(response)
            time.sleep(delay)
            attempt += 1

    def result(self, task_id: str, pages: str | None = None) -> Any:
        """A succeeded task's result (``GET /tasks/<id>/result``), whole or (``pages``:
        ``"1-100"``) a range of the entries a task split into parts stored."""
        return self._send_any(_result_request(task_id, pages))

    def submit(
        self,
        task_type: str | None = None,
        args: dict[str, Any] | None = None,
        *,
        cls: str | None = None,
        file: FileArg | None = None,
        filename: str | None = None,
        timeout_s: float | None = None,
        idempotency_key: str | None = None,
    ) -> dict[str, Any]:
        return self._send(
            _submit_request(task_type, args, cls, file, filename, timeout_s, idempotency_key)
        )

    def get(self, task_id: str) -> dict[str, Any]:
        return self._send(_Request("GET", f"/tasks/{task_id}"))

    def cancel(self, task_id: str) -> dict[str, Any]:
        return self._send(_Request("DELETE", f"/tasks/{task_id}"))

    def queues(self) -> dict[str, Any]:
        return self._send(_Request("GET", "/queues"))

    def workers(self) -> dict[str, Any]:
        return self._send(_Request("GET", "/workers"))

    def wait(
        self,
        task_id: str,
        *,
        timeout_s: float | None = None,
        wait_s: float = 30.0,
        on_update: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """Long-poll (``GET /tasks/<id>?wait=N``, N at most ``wait_s``) until the task is
        final: the answer comes the moment it ends. ``on_update`` sees every record
        read: one per long-poll, so a smaller ``wait_s`` shows progress more often."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            req, n = _long_poll(task_id, wait_s, deadline)
            started = time.monotonic()
            record = self._send(req)
            if on_update:
                on_update(record)
            if record["status"] in FINAL:
                if record.get("result_url"):  # stored in parts, too large for the record
                    return {**record, "result": self.result(task_id)}
                return record
            if deadline is not None and time.monotonic() >= deadline:
                raise _timed_out(task_id, record, timeout_s)
            time.sleep(_early(started, n))


class AsyncClient(_Base):
    """asyncio client (``httpx.AsyncClient`` underneath)."""

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        *,
        timeout_s: float = 30.0,
        max_retries: int = 5,
        max_delay_s: float = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__(url, api_key, max_retries, max_delay_s)
        self._http = httpx.AsyncClient(base_url=self.url, timeout=timeout_s, transport=transport)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _send(self, req: _Request) -> dict[str, Any]:
        result: dict[str, Any] = await self._send_any(req)
        return result

    async def _send_any(self, req: _Request) -> Any:
        attempt = 0
        while True:
            try:
                response = await self._http.request(req.method, req.path, **self._kwargs(req))
            except httpx.TransportError:
                response = None
            delay = self._retry_in(attempt, response)
            if delay is None:
                return self._value(response)
            await asyncio.sleep(delay)
            attempt += 1

    async def result(self, task_id: str, pages: str | None = None) -> Any:
        """A succeeded task's result (``GET /tasks/<id>/result``), whole or (``pages``:
        ``"1-100"``) a range of the entries a task split into parts stored."""
        return await self._send_any(_result_request(task_id, pages))

    async def submit(
        self,
        task_type: str | None = None,
        args: dict[str, Any] | None = None,
        *,
        cls: str | None = None,
        file: FileArg | None = None,
        filename: str | None = None,
        timeout_s: float | None = None,
        idempotency_key: str | None = None,
    ) -> dict[str, Any]:
        return await self._send(
            _submit_request(task_type, args, cls, file, filename, timeout_s, idempotency_key)
        )

    async def get(self, task_id: str) -> dict[str, Any]:
        return await self._send(_Request("GET", f"/tasks/{task_id}"))

    async def cancel(self, task_id: str) -> dict[str, Any]:
        return await self._send(_Request("DELETE", f"/tasks/{task_id}"))

    async def queues(self) -> dict[str, Any]:
        return await self._send(_Request("GET", "/queues"))

    async def workers(self) -> dict[str, Any]:
        return await self._send(_Request("GET", "/workers"))

    async def wait(
        self,
        task_id: str,
        *,
        timeout_s: float | None = None,
        wait_s: float = 30.0,
        on_update: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """Long-poll (``GET /tasks/<id>?wait=N``, N at most ``wait_s``) until the task is
        final: the answer comes the moment it ends. ``on_update`` sees every record
        read: one per long-poll, so a smaller ``wait_s`` shows progress more often."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            req, n = _long_poll(task_id, wait_s, deadline)
            started = time.monotonic()
            record = await self._send(req)
            if on_update:
                on_update(record)
            if record["status"] in FINAL:
                if record.get("result_url"):  # stored in parts, too large for the record
                    return {**record, "result": await self.result(task_id)}
                return record
            if deadline is not None and time.monotonic() >= deadline:
                raise _timed_out(task_id, record, timeout_s)
            await asyncio.sleep(_early(started, n))
