"""An OpenAI-compatible inference server (vLLM, TGI, SGLang, llama.cpp's server,
Infinity) as a backend worker sees it: its models, its health, a call and a stream.

Failures come in two kinds, because they are handled differently:

- :class:`BackendDown`: the server could not be reached, or the connection broke
  (refused, reset, timed out). Not the task's fault: a task with nothing sent to its
  client yet runs again elsewhere.
- :class:`BackendError`: the server answered, with an error status or a body that is
  not what the protocol says. The task fails ``backend_error`` with the status.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson

__all__ = ["PATHS", "Backend", "BackendDown", "BackendError"]

# A backend task's kind -> the route it is forwarded to.
PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "embeddings": "/v1/embeddings",
}
_MAX_ERROR_CHARS = 500  # of a backend's error body, in the task's error message
_MAX_BODY_BYTES = 64 * 1024 * 1024  # a non-streamed answer larger than this is garbage


class BackendDown(Exception):
    """The backend could not be reached or the connection broke."""


class BackendError(Exception):
    """The backend answered with an error status or a malformed body."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _detail(status: int, text: str) -> BackendError:
    """The error for a status the server answered: its own message when its body is
    OpenAI's error shape, else the start of the body."""
    try:
        error = json.loads(text).get("error")
        message = error.get("message") if isinstance(error, dict) else error
    except (ValueError, AttributeError):
        message = None
    if not isinstance(message, str) or not message:
        message = text.strip().replace("\n", " ") or "(empty body)"
    return BackendError(status, f"The backend answered {status}: {message[:_MAX_ERROR_CHARS]}")


class Backend:
    """One server. ``api_key``: sent as ``Authorization: Bearer`` when set."""

    def __init__(self, url: str, api_key: str | None, probe_timeout_s: float = 2.0) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # No read timeout on calls: a generation may think for minutes between tokens;
        # the task's own timeout bounds it. Connecting is bounded.
        self._client = httpx.AsyncClient(
            base_url=self.url,
            headers=headers,
            timeout=httpx.Timeout(None, connect=5.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )
        self._probe_timeout = httpx.Timeout(probe_timeout_s)

    async def close(self) -> None:
        await self._client.aclose()

    async def models(self) -> dict[str, int | None]:
        """The model ids the server lists on ``GET /v1/models``, each with its context
        length when the server says (vLLM's ``max_model_len``)."""
        body = await self._get_json("/v1/models", self._probe_timeout)
        data = body.get("data") if isinstance(body, dict) else None
        if not isinstance(data, list):
            raise BackendError(200, "GET /v1/models did not answer {'data': [...]}.")
        out: dict[str, int | None] = {}
        for m in data:
            model_id = m.get("id") if isinstance(m, dict) else None
            if isinstance(model_id, str) and model_id:
                context = m.get("max_model_len")
                out[model_id] = context if isinstance(context, int) and context > 0 else None
        return out

    async def probe(self) -> str | None:
        """None when the server answers; else why not. ``GET /health`` (vLLM, TGI,
        SGLang, llama.cpp's server, Infinity): any answer below 500 means the server
        is there (llama-cpp-python has no such route and says 404), a 5xx that it is
        not serving, no answer that it is gone. Not ``/v1/models``: some servers hold
        that behind the lock of the generation in progress."""
        try:
            response = await self._client.get("/health", timeout=self._probe_timeout)
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}".rstrip(": ")
        if response.status_code >= 500:
            return f"GET /health answered {response.status_code}"
        return None

    async def call(self, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        """A whole answer (not streamed), as the backend's JSON object."""
        try:
            response = await self._client.post(PATHS[kind], json=body)
        except httpx.HTTPError as exc:
            raise BackendDown(f"{type(exc).__name__}: {exc}") from exc
        if response.status_code >= 400:
            raise _detail(response.status_code, response.text)
        if len(response.content) > _MAX_BODY_BYTES:
            raise BackendError(response.status_code, "The backend's answer is too large.")
        try:
            answer = response.json()
        except ValueError:
            raise _detail(response.status_code, f"not JSON: {response.text}") from None
        if not isinstance(answer, dict):
            raise _detail(response.status_code, f"not a JSON object: {response.text}")
        return answer

    async def stream(
        self, kind: str, body: dict[str, Any]
    ) -> AsyncIterator[tuple[dict[str, Any], bytes]]:
        """The answer's SSE chunks, each as a JSON object and as the server wrote it,
        until ``data: [DONE]``. Closing the iterator closes the connection, which is
        how a server learns that its client left and stops generating."""
        try:
            async with self._client.stream("POST", PATHS[kind], json=body) as response:
                if response.status_code >= 400:
                    raise _detail(
                        response.status_code, (await response.aread()).decode("utf-8", "replace")
                    )
                async for line in response.aiter_lines():
                    event = _event(line)
                    if event is None:
                        continue
                    if event is _DONE:
                        return
                    yield event
        except httpx.HTTPError as exc:
            raise BackendDown(f"{type(exc).__name__}: {exc}") from exc
        # Every OpenAI-compatible server ends a whole stream with [DONE]: one that
        # stops without it (llama-cpp-python, when it fails after answering 200) is
        # incomplete, and passing it on as whole would be a silent partial answer.
        raise BackendError(200, "The backend's stream ended without data: [DONE].")

    async def _get_json(self, path: str, timeout: httpx.Timeout) -> Any:
        try:
            response = await self._client.get(path, timeout=timeout)
        except httpx.HTTPError as exc:
            raise BackendDown(f"{type(exc).__name__}: {exc}") from exc
        if response.status_code >= 400:
            raise _detail(response.status_code, response.text)
        try:
            return response.json()
        except ValueError:
            raise _detail(response.status_code, f"not JSON: {response.text}") from None


_DONE: tuple[dict[str, Any], bytes] = ({}, b"")  # the end marker, compared by identity


def _event(line: str) -> tuple[dict[str, Any], bytes] | None:
    """One SSE line: a chunk (parsed, and its JSON as sent), ``_DONE``, or None (a
    comment, a blank line, another field). A ``data:`` line that is not a JSON object
    is the backend's garbage."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return _DONE
    raw = data.encode()
    try:
        chunk = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise BackendError(
            200, f"The backend streamed a chunk that is not JSON: {data[:200]}"
        ) from None
    if not isinstance(chunk, dict):
        raise BackendError(200, f"The backend streamed a chunk that is not an object: {data[:200]}")
    if "error" in chunk and "choices" not in chunk:  # an error reported mid-stream
        raise BackendError(
            200, f"The backend reported an error mid-stream: {data[:_MAX_ERROR_CHARS]}"
        )
    return chunk, raw
