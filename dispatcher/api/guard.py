"""Slow and hostile clients: read deadlines and a connection cap per API process.

uvicorn closes idle keep-alive connections, but it has no deadline for reading a
request: a client that trickles its headers or body a few bytes at a time holds a
connection (and, with a body, a running request) forever, and enough of them starve
real clients. :class:`GuardedProtocol` is uvicorn's httptools protocol with

- a header deadline: the request line and headers must arrive within
  ``header_timeout_s`` of the connection opening (and, on a kept-alive connection, of
  the request's first byte);
- a body deadline: the whole body within ``body_timeout_s`` of the headers;
- a cap: past ``max_connections`` open connections in this process, a new one is
  answered ``503 server_busy`` and closed at once.

A missed deadline is answered ``408 request_timeout`` (unless a response has begun)
and the connection is closed; a request the app was handling sees a client
disconnect. The answers are written by the protocol itself, in the API's error body
format. :func:`server_options` gives uvicorn these and the keep-alive timeout.
"""

from __future__ import annotations

import functools
import json
import logging
from asyncio import TimerHandle, Transport
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from dispatcher.contract.settings import Settings

__all__ = ["GuardedProtocol", "server_options"]

log = logging.getLogger("gpulane.api")

KEEP_ALIVE_S = 5
BUSY_RETRY_AFTER_S = 1


def _raw_response(status: bytes, code: str, message: str, extra: bytes = b"") -> bytes:
    body = json.dumps({"error": code, "message": message}).encode()
    head = (
        b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n" + extra
    )
    return head + b"\r\n" + body


_HEADERS_TIMEOUT = _raw_response(
    b"408 Request Timeout", "request_timeout", "The request headers did not arrive in time."
)
_BODY_TIMEOUT = _raw_response(
    b"408 Request Timeout", "request_timeout", "The request body did not arrive in time."
)
_MALFORMED = _raw_response(
    b"400 Bad Request",
    "invalid_request",
    "The request is not valid HTTP/1.1 (request line, headers, Content-Length or chunking).",
)
_BUSY = _raw_response(
    b"503 Service Unavailable",
    "server_busy",
    "Too many open connections to this API process; retry shortly.",
    b"retry-after: " + str(BUSY_RETRY_AFTER_S).encode() + b"\r\n",
)


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with header and body deadlines and a cap."""

    def __init__(
        self,
        *args: Any,
        header_timeout_s: float,
        body_timeout_s: float,
        max_connections: int,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._header_timeout_s = header_timeout_s
        self._body_timeout_s = body_timeout_s
        self._max_connections = max_connections
        self._deadline: TimerHandle | None = None

    def _arm(self, delay_s: float, on_expiry: Callable[[], None]) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(delay_s, on_expiry)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def connection_made(self, transport: Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self._max_connections:
            transport.write(_BUSY)
            transport.close()
            return
        self._arm(self._header_timeout_s, self._headers_too_slow)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm(self._header_timeout_s, self._headers_too_slow)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._arm(self._body_timeout_s, self._body_too_slow)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()

    def send_400_response(self, msg: str) -> None:
        """What the HTTP parser refuses (a bad Content-Length, both Content-Length and
        chunked): the API's JSON error body, not uvicorn's plain text."""
        log.debug("closed a connection whose request was not valid HTTP: %s", msg)
        self.transport.write(_MALFORMED)
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _headers_too_slow(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            log.debug("closed a connection whose request headers were too slow")
            self.transport.write(_HEADERS_TIMEOUT)
            self.transport.close()

    def _body_too_slow(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        started = cycle is not None and cycle.response_started
        if cycle is not None:  # the app's receive() returns http.disconnect; its reply is dropped
            cycle.disconnected = True
            cycle.message_event.set()
        log.debug("closed a connection whose request body was too slow")
        if not started:
            self.transport.write(_BODY_TIMEOUT)
        self.transport.close()


def server_options(settings: Settings) -> dict[str, Any]:
    """uvicorn keyword arguments: the guarded protocol and the keep-alive timeout."""
    protocol = functools.partial(
        GuardedProtocol,
        header_timeout_s=settings.header_timeout_s,
        body_timeout_s=settings.body_timeout_s,
        max_connections=settings.max_connections,
    )
    return {"http": protocol, "timeout_keep_alive": KEEP_ALIVE_S}
