"""Health and observability routes: ``GET /health`` (liveness and readiness),
``GET /metrics`` (Prometheus), ``GET /stats`` (JSON for the
dashboard) and ``GET /`` (the live dashboard, with its files under ``/static/``).

Auth follows the pool routes: with API keys configured, ``/metrics`` needs an admin
key like ``/workers`` (it lists every worker), ``/stats`` any key, filtered to the
classes the key may use like ``/queues``. The dashboard page itself holds no data and
is public; its script asks for a key when the API answers 401.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from importlib import resources
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, PlainTextResponse
from redis.exceptions import RedisError

from dispatcher.api.deps import caller, services
from dispatcher.api.errors import STORE_RETRY_AFTER_S, ApiError, error_body, error_responses
from dispatcher.api.exporter import pool_families, read_recorded, redis_families, render
from dispatcher.api.stats import LatencyWindow, class_stats, latency_by_class, token_stats
from dispatcher.api.usage import device_stats
from dispatcher.contract.workers import NOT_SERVING

__all__ = ["router"]

router = APIRouter(tags=["observability"])

# The page talks only to this origin and loads nothing from elsewhere: it works
# offline, and an injected script or a CDN outage cannot change what it shows.
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".png": "image/png",
}


def _load_static() -> dict[str, tuple[bytes, str, str]]:
    """name -> (bytes, content type, ETag). Read once: the dashboard's files and Swagger
    UI's (about 2 MB), served from memory; an unknown name never reaches the file system."""
    out = {}
    for entry in resources.files("dispatcher.api").joinpath("static").iterdir():
        suffix = "." + entry.name.rsplit(".", 1)[-1]
        if entry.is_file() and suffix in _TYPES:
            body = entry.read_bytes()
            etag = '"' + hashlib.sha256(body).hexdigest()[:16] + '"'
            out[entry.name] = (body, _TYPES[suffix], etag)
    return out


_STATIC = _load_static()


def _asset(name: str, request: Request) -> Response:
    found = _STATIC.get(name)
    if found is None:
        raise ApiError(404, "not_found", f"No route {request.url.path}.")
    body, content_type, etag = found
    # no-cache: revalidate every load (a 304 is tiny), so an upgrade shows at once.
    headers = {"ETag": etag, "Cache-Control": "no-cache", "Content-Security-Policy": _CSP}
    if request.headers.get("if-none-match") == etag:
        return Response(status_code=304, headers=headers)
    return Response(body, headers=headers, media_type=content_type)


@router.get(
    "/metrics",
    summary="Prometheus metrics of the whole pool",
    response_class=PlainTextResponse,
    responses={
        200: {"content": {"text/plain": {}}, "description": "Prometheus text"},
        **error_responses(401, 404, 429, 503),
    },
)
async def metrics(request: Request) -> Response:
    """Counters, gauges and histograms named in docs/design.md, aggregated over the whole
    pool through Redis (any replica exports the same series), plus this API process's
    `process_*` and `python_*` metrics. Prometheus text; OpenMetrics when `Accept`
    asks for it. Admin key needed when keys are configured."""
    svc = services(request)
    try:
        principal = await caller(request)
    except RedisError:  # the rate limit lives in Redis, the key check does not: a scrape
        principal = svc.auth.authenticate(request.headers.get("authorization"))
    if not principal.admin:
        raise ApiError(404, "not_found", "No route /metrics for this key.")
    # Gauges from the snapshot the maintenance loop refreshes every heartbeat: the
    # counters beside them are that fresh anyway; a scrape costs one HGETALL and one INFO.
    try:
        recorded, snap, memory = await asyncio.gather(
            read_recorded(svc.client), svc.pool.cached(), _memory(svc)
        )
        families = [*pool_families(recorded, snap), *redis_families(memory)]
    except RedisError:  # still a 200: gpulane_redis_up 0 is what an alert needs
        families = redis_families(None)
    body, content_type = render(families, request.headers.get("accept", ""))
    return Response(body, headers={"Content-Type": content_type})


def _window(request: Request) -> LatencyWindow:
    window: LatencyWindow | None = getattr(request.app.state, "latency_window", None)
    if window is None:
        window = request.app.state.latency_window = LatencyWindow()
    return window


@router.get(
    "/stats",
    summary="Per-class task counts and latency percentiles (JSON)",
    responses=error_responses(401, 429, 503),
)
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
    has not been asked before. Percentiles are null without tasks.

    `tokens`: model tokens generations used through backend workers, `{tenant: {model:
    {"prompt", "completion"}}}` (a tenant's key sees its own).

    `device_seconds`: device time the tasks used since the metrics began, as their
    workers measured it, `{tenant: {"total", "classes": {class: {type: seconds}}}}` (a
    tenant's key sees its own; `GET /usage` reads it by minute)."""
    svc = services(request)
    principal = await caller(request)
    recorded = await read_recorded(svc.client)
    recent = _window(request).since(time.monotonic(), latency_by_class(recorded))
    return {
        "classes": [
            class_stats(cls, recorded, recent)
            for cls in svc.settings.class_names
            if principal.may_use(cls)
        ],
        "tokens": token_stats(recorded, principal.task_scope),
        "device_seconds": device_stats(recorded, principal.task_scope),
    }


@router.get("/", summary="Live dashboard (HTML)", response_class=HTMLResponse)
async def dashboard(request: Request) -> Response:
    """Queues, latency, rejections and workers, refreshed every second from `/queues`,
    `/workers` and `/stats`. Self-contained: no CDN, works offline."""
    return _asset("index.html", request)


@router.get("/docs", include_in_schema=False)
async def swagger_ui(request: Request) -> Response:
    """Swagger UI from this origin (dispatcher/api/static, swagger-ui-dist): it works
    offline and on air-gapped hosts, unlike FastAPI's default CDN page."""
    root = request.scope.get("root_path", "")
    return get_swagger_ui_html(
        openapi_url=f"{root}{request.app.openapi_url}",
        title="gpulane API",
        swagger_js_url=f"{root}/static/swagger-ui-bundle.js",
        swagger_css_url=f"{root}/static/swagger-ui.css",
        swagger_favicon_url=f"{root}/static/swagger-favicon.png",
    )


@router.get("/static/{name}", include_in_schema=False)
async def static_file(name: str, request: Request) -> Response:
    return _asset(name, request)


HEALTH_RESPONSES = error_responses(503)
FULL_MEMORY_S = 10.0  # /health says "full" this long after Redis refused a write for memory


async def _memory(svc: Any) -> dict[str, int | None]:
    """Redis' memory use (INFO memory: one call, and the liveness check too)."""
    info = await svc.client.info("memory")
    limit = int(info.get("maxmemory", 0))
    return {"used_bytes": int(info.get("used_memory", 0)), "max_bytes": limit or None}


@router.get("/health", tags=["pool"], responses=HEALTH_RESPONSES)
async def health(request: Request, response: Response) -> dict[str, Any]:
    """200 while Redis answers (`status` `degraded`, `redis` `full` while it is at
    `maxmemory`: reads work, submits are refused), else 503."""
    svc = services(request)
    try:
        memory = await _memory(svc)
    except RedisError:
        response.status_code = 503
        response.headers["Retry-After"] = str(STORE_RETRY_AFTER_S)
        return {
            "status": "unavailable",
            "redis": "unreachable",
            "workers": None,
            **error_body("store_unavailable", "The task store (Redis) is unreachable."),
        }
    limit = memory["max_bytes"]
    refused_at = getattr(request.app.state, "redis_full_at", None)
    full = limit is not None and (
        (memory["used_bytes"] or 0) >= limit
        or (refused_at is not None and time.monotonic() - refused_at < FULL_MEMORY_S)
    )
    snap = svc.pool.latest
    workers = snap.workers if snap else []
    return {
        "status": "degraded" if full else "ok",
        "redis": "full" if full else "ok",
        "memory": memory,
        "workers": len(workers),
        # Live workers able to take a task now (not starting, waiting for a GPU or
        # unhealthy): what a readiness check wants.
        "serving": sum(w["state"] not in NOT_SERVING for w in workers),
    }
