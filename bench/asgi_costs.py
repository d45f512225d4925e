"""CPU per ``POST /tasks`` inside the API process, without an HTTP server.

Drives ASGI apps directly (one request at a time, same JSON body as the load test)
and reads the process CPU clock, so the numbers are CPU cost, not waiting:

- the real gpulane app (``create_app``) against a real Redis;
- the same app with ``TaskStore.submit`` replaced by a stub that accepts without
  Redis (so the difference is the cost of the redis-py submit call);
- a bare FastAPI route (:mod:`bench.floor_app`), the framework's floor.

:func:`hot_spots` profiles the stubbed app with cProfile and reports the cumulative
time per request of gpulane's own request-path functions.
"""

from __future__ import annotations

import cProfile
import json
import pstats
import time
from collections.abc import Awaitable, Callable
from typing import Any

from bench.floor_app import fastapi_app
from bench.harness import OPEN_CLASS
from dispatcher.api import store as store_mod
from dispatcher.api.app import create_app
from dispatcher.contract.settings import ClassConfig, Settings

App = Callable[..., Awaitable[None]]

# gpulane functions on the submit path, as cProfile names them (file:function).
GPULANE_STEPS = {
    "routes.py:submit_task": "submit_task (whole handler)",
    "submission.py:parse_submission": "parse_submission: read + validate body",
    "submission.py:_task_type": "catalog lookup + JSON Schema validation",
    "routes.py:caller": "authenticate (+ tenant rate limit)",
    "pool.py:cached": "admission snapshot",
    "admission.py:pressure": "pressure header",
    "metrics.py:count": "metrics counter",
}


def _scope(body: bytes) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/tasks",
        "raw_path": b"/tasks",
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"host", b"127.0.0.1"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }


async def _drive(app: App, body: dict[str, Any], n: int) -> float:
    """CPU microseconds per request over ``n`` requests (after ``n // 5`` warm-up)."""
    raw = json.dumps(body).encode()
    statuses: set[int] = set()

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            statuses.add(message["status"])

    for _ in range(max(n // 5, 1)):
        await app(_scope(raw), receive, send)
    start = time.process_time()
    for _ in range(n):
        await app(_scope(raw), receive, send)
    cpu = (time.process_time() - start) / n * 1e6
    if statuses != {202}:
        raise RuntimeError(f"unexpected statuses {statuses}")
    return cpu


async def _stub_submit(self: Any, sub: Any, state: Any) -> Any:
    return store_mod.SubmitResult("accepted", "0" * 36, 1, None, "queued", sub.cls, sub.task_type)


async def measure(
    redis_url: str, classes: list[str], body: dict[str, Any], n: int
) -> dict[str, Any]:
    settings = Settings(
        redis_url=redis_url, classes={c: ClassConfig(**OPEN_CLASS) for c in classes}
    )
    app = create_app(settings)
    out: dict[str, Any] = {}
    async with app.router.lifespan_context(app):
        out["real"] = await _drive(app, body, n)
        real_submit = store_mod.TaskStore.submit
        store_mod.TaskStore.submit = _stub_submit  # type: ignore[method-assign]
        try:
            out["stub"] = await _drive(app, body, n)
            profiler = cProfile.Profile()
            profiler.enable()
            await _drive(app, body, n)
            profiler.disable()
        finally:
            store_mod.TaskStore.submit = real_submit  # type: ignore[method-assign]
    out["bare"] = await _drive(fastapi_app, body, n)
    out["steps"] = hot_spots(profiler, n + max(n // 5, 1))
    return out


def hot_spots(profiler: cProfile.Profile, requests: int) -> list[tuple[str, float]]:
    """Cumulative microseconds per request of :data:`GPULANE_STEPS` (cProfile-inflated)."""
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    found: dict[str, float] = {}
    for (path, _line, func), (_cc, _nc, _tt, ct, _callers) in stats.items():
        key = f"{path.rsplit('/', 1)[-1]}:{func}"
        if key in GPULANE_STEPS:
            found[key] = found.get(key, 0.0) + ct
    return [(label, found.get(key, 0.0) / requests * 1e6) for key, label in GPULANE_STEPS.items()]
