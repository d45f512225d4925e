"""Observability routes: ``GET /metrics`` (Prometheus).

Auth follows the pool routes: with API keys configured, ``/metrics`` needs an admin
key like ``/workers`` (it lists every worker).
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request, Response
from fastapi.responses import PlainTextResponse

from dispatcher.exporter import pool_families, read_recorded, render
from dispatcher.routes import _admin, _services

__all__ = ["router"]

router = APIRouter(tags=["observability"])


@router.get(
    "/metrics",
    summary="Prometheus metrics of the whole pool",
    response_class=PlainTextResponse,
    responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text"}},
)
async def metrics(request: Request) -> Response:
    """Counters, gauges and histograms named in DESIGN.md, aggregated over the whole
    pool through Redis (any replica exports the same series), plus this API process's
    `process_*` and `python_*` metrics. Prometheus text; OpenMetrics when `Accept`
    asks for it. Admin key needed when keys are configured."""
    svc = _services(request)
    _admin(request)
    recorded, snap = await asyncio.gather(read_recorded(svc.client), svc.pool.snapshot())
    body, content_type = render(pool_families(recorded, snap), request.headers.get("accept", ""))
    return Response(body, headers={"Content-Type": content_type})
