"""A minimal HTTP/1.1 load generator: N keep-alive connections, each sending the next
request as soon as the previous response arrived (closed loop, like ``wrk``).

It uses prebuilt request bytes and parses only the status line and
``Content-Length``, so on a 2-core machine nearly all CPU goes to the server under
test rather than to the client (``httpx`` costs several times more per request).
"""

from __future__ import annotations

import asyncio
import json
import resource
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit


@dataclass
class Load:
    latencies_s: list[float] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)
    seconds: float = 0.0
    client_cpu_s: float = 0.0

    @property
    def accepted_per_s(self) -> float:
        return self.statuses[202] / self.seconds if self.seconds else 0.0


def post_json(url: str, path: str, body: Mapping[str, Any]) -> bytes:
    parts = urlsplit(url)
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    return head.encode() + payload


async def _connection(
    host: str, port: int, request: bytes, until: float, out: Load, record_from: float
) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while (start := time.perf_counter()) < until:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            await reader.readexactly(length)
            if start >= record_from:
                out.latencies_s.append(time.perf_counter() - start)
                out.statuses[int(head[9:12])] += 1
    finally:
        writer.close()


async def _run(url: str, request: bytes, clients: int, seconds: float, warmup_s: float) -> Load:
    parts = urlsplit(url)
    out = Load()
    now = time.perf_counter()
    record_from, until = now + warmup_s, now + warmup_s + seconds
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    await asyncio.gather(
        *(
            _connection(
                parts.hostname or "127.0.0.1", parts.port or 80, request, until, out, record_from
            )
            for _ in range(clients)
        )
    )
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    out.seconds = seconds
    out.client_cpu_s = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
    return out


def run(url: str, request: bytes, clients: int, seconds: float, warmup_s: float = 1.0) -> Load:
    """Closed-loop load for ``warmup_s`` (not recorded) plus ``seconds`` (recorded)."""
    try:
        import uvloop

        return uvloop.run(_run(url, request, clients, seconds, warmup_s))
    except ImportError:
        return asyncio.run(_run(url, request, clients, seconds, warmup_s))
