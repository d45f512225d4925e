"""What-if builds of the real gpulane API, to measure proposed changes before making
them. Nothing here changes gpulane: each factory patches the app in its own process.

- ``bench.whatif_api:stock``: the unchanged app (``create_app(load_settings())``), as a
  uvicorn ``--factory`` target, so it can run with ``--workers 2``.
- ``bench.whatif_api:frozen``: the app with ``gc.freeze()`` once startup is done, so
  the cyclic GC's periodic full collections stop traversing every object the imports
  created (on a 2-core VM each took 70-110 ms, stalling every in-flight request).
- ``bench.whatif_api:tuned``: ``frozen`` plus ``submit.lua`` calls issued while one is
  in flight sent together as one pipeline (:class:`bench.floor_app.Coalescer`): the
  change proposed for ``TaskStore.submit``.
"""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from bench.floor_app import Coalescer
from dispatcher.app import create_app
from dispatcher.scripts import AsyncScripts, source
from dispatcher.settings import load_settings


def stock() -> FastAPI:
    return create_app(load_settings())


def _freeze_after_startup(app: FastAPI) -> FastAPI:
    startup = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(app_: FastAPI) -> AsyncIterator[None]:
        async with startup(app_):
            gc.freeze()
            yield

    app.router.lifespan_context = lifespan
    return app


def frozen() -> FastAPI:
    return _freeze_after_startup(create_app(load_settings()))


def _coalesce_submits() -> None:
    original = AsyncScripts.run
    coalescers: dict[int, Coalescer] = {}

    async def run(self: AsyncScripts, name: str, opts: str, *payload: bytes | str) -> Any:
        if name != "submit":
            return await original(self, name, opts, *payload)
        coalescer = coalescers.get(id(self))
        if coalescer is None:
            coalescer = coalescers[id(self)] = Coalescer(self.client, source("submit"))
        return await coalescer.call(opts, *payload)

    AsyncScripts.run = run  # type: ignore[method-assign]


def tuned() -> FastAPI:
    _coalesce_submits()
    return frozen()
