"""Reference apps for the API scenario: what one uvicorn process can serve on this
machine with no gpulane code, to separate the framework's floor from gpulane's cost.

- ``bench.floor_app:fastapi_app``: a bare FastAPI ``POST /tasks`` that reads the JSON
  body and answers 202 with a body and headers shaped like gpulane's.
- ``bench.floor_app:redis_app``: the same plus one ``submit.lua`` call per request
  (what gpulane's submit costs in Redis), without validation, admission or metrics.

"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from redis.asyncio import Redis

from bench.harness import UNLIMITED
from dispatcher.api.coalesce import AsyncScripts
from dispatcher.api.store import Submission, submit_options
from dispatcher.contract.jobs import encode_call
from dispatcher.contract.settings import Settings

HEADERS = {"Gpulane-Queue-Depth": "1", "Gpulane-Estimated-Wait": "-1", "Gpulane-Pressure": "ok"}


def _reply(task_id: str, body: dict[str, Any]) -> JSONResponse:
    out = {
        "id": task_id,
        "status": "queued",
        "type": body.get("type"),
        "class": "batch",
        "position": 0,
        "estimated_wait_s": None,
    }
    return JSONResponse(out, status_code=202, headers={**HEADERS, "Location": f"/tasks/{task_id}"})


fastapi_app = FastAPI()


@fastapi_app.post("/tasks")
async def bare_submit(request: Request) -> JSONResponse:
    body = json.loads(await request.body())
    return _reply(str(uuid.uuid4()), body)


_SETTINGS = Settings()


def _submit_args(body: dict[str, Any]) -> tuple[str, bytes, bytes]:
    sub = Submission(body["type"], "batch", body.get("args", {}), 600.0, "default")
    opts = submit_options(sub, UNLIMITED, 0, 1.0, _SETTINGS)
    return opts, encode_call(body["type"], body.get("args", {})), b""


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    client = Redis.from_url(os.environ["GPULANE_REDIS_URL"], socket_timeout=5)
    app.state.scripts = AsyncScripts(client)
    yield
    await client.aclose()


redis_app = FastAPI(lifespan=_lifespan)


@redis_app.post("/tasks")
async def redis_submit(request: Request) -> JSONResponse:
    body = json.loads(await request.body())
    reply = await request.app.state.scripts.run("submit", *_submit_args(body))
    return _reply(reply[1].decode(), body)  # the id the script stored
