"""Observability routes: ``GET /metrics`` (Prometheus) and ``GET /stats`` (JSON for the
dashboard).

Auth follows the pool routes: with API keys configured, ``/metrics`` needs an admin
key like ``/workers`` (it lists every worker), ``/stats`` any key, filtered to the
classes the key may use like ``/queues``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import PlainTextResponse

from dispatcher.exporter import pool_families, read_recorded, render
from dispatcher.routes import _admin, _principal, _services
from dispatcher.stats import LatencyWindow, class_stats, latency_by_class

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


def _window(request: Request) -> LatencyWindow:
    window: LatencyWindow | None = getattr(request.app.state, "latency_window", None)
    if window is None:
        window = request.app.state.latency_window = LatencyWindow()
    return window


@router.get("/stats", summary="Per-class task counts and latency percentiles (JSON)")
async def stats(request: Request) -> dict[str, Any]:
    """What the dashboard shows beside `/queues` and `/workers`, one entry per class in
    priority order (only the classes the key may use):

    `{"classes": [{"name", "submitted", "rejected": {reason: n}, "finished":
    {"succeeded", "failed", "canceled"}, "requeued", "latency_s": {"p50", "p95", "p99",
    "count", "window_s"}}]}`

    Counts are pool-wide totals since the metrics began (the Prometheus counters,
    summed over task types). `latency_s` is submit-to-final time, estimated from the
    `gpulane_task_latency_seconds` buckets like PromQL's `histogram_quantile`, over the
    tasks that finished in the last `window_s` seconds (up to 300); `window_s` is null
    when it covers every task so far, because none finished recently or this replica
    has not been asked before. Percentiles are null without tasks."""
    svc = _services(request)
    principal = _principal(request)
    recorded = await read_recorded(svc.client)
    recent = _window(request).since(time.monotonic(), latency_by_class(recorded))
    return {
        "classes": [
            class_stats(cls, recorded, recent)
            for cls in svc.settings.class_names
            if principal.may_use(cls)
        ]
    }
