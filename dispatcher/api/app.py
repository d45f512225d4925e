"""The API application: ``create_app(settings)`` and its background maintenance.

The API is stateless: any number of replicas may run against one Redis. Each one runs
a maintenance loop every heartbeat that reaps dead workers' tasks (one pass pool-wide,
by lock), refreshes the pool snapshot admission reads, re-reads the task catalog and
flushes its metrics. Each also holds one subscription to task events, which wakes the
requests waiting on tasks (``api/waiters.py``).
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from redis.asyncio import Redis
from redis.exceptions import OutOfMemoryError, RedisError, ResponseError

from dispatcher.api.auth import Authenticator
from dispatcher.api.deps import Services
from dispatcher.api.errors import install_error_handlers
from dispatcher.api.openapi import install_openapi
from dispatcher.api.pool import Pool
from dispatcher.api.ratelimit import RateLimiter
from dispatcher.api.routes import events, generate, observe, openai, queues, results, tasks, usage
from dispatcher.api.store import TaskStore
from dispatcher.api.task_types import Catalog, TaskTypeInfo
from dispatcher.api.waiters import Waiters
from dispatcher.contract import keys
from dispatcher.contract.backoff import Backoff
from dispatcher.contract.connect import async_client
from dispatcher.contract.metrics import Recorder
from dispatcher.contract.reap import parse_reaped, reap_options, record_reaped
from dispatcher.contract.settings import Settings

__all__ = ["app_from_environment", "create_app"]

log = logging.getLogger("gpulane.api")

CATALOG_REFRESH_S = 2.0


async def _flush_metrics(client: Redis, recorder: Recorder) -> None:
    drained = recorder.drain()
    if not drained:
        return
    pipe = client.pipeline(transaction=True)
    for field, n in drained.counters.items():
        pipe.hincrby(keys.METRICS, field, n)
    for field, x in drained.floats.items():
        pipe.hincrbyfloat(keys.METRICS, field, x)
    try:
        await pipe.execute()
    except RedisError:
        recorder.restore(drained)
        raise


async def _maintain_once(svc: Services, catalog_due: bool) -> None:
    """One pass. Redis full (maxmemory) refuses the writes (reap, metrics flush) whole;
    the reads go on, so /queues, /workers and admission stay current, and the writes
    resume by themselves once memory frees (the reaper then extends every lease once,
    invariant 9; the metrics were kept)."""
    try:
        reaped = parse_reaped(await svc.store.scripts.run("reap", reap_options(svc.settings)))
        record_reaped(reaped, svc.recorder, "gave back a dead worker's task")
    except OutOfMemoryError:
        log.warning("redis is full (maxmemory): reaper pass skipped")
    await svc.pool.snapshot()
    if catalog_due:
        await svc.catalog.refresh()
    try:
        await _flush_metrics(svc.client, svc.recorder)
    except OutOfMemoryError:
        log.warning("redis is full (maxmemory): metrics kept until it has room")


async def _maintain(svc: Services) -> None:
    backoff = Backoff(cap_s=svc.settings.heartbeat_interval_s * 2)
    interval = svc.settings.heartbeat_interval_s
    loop = asyncio.get_running_loop()
    catalog_at = 0.0
    down = False
    while True:
        try:
            due = loop.time() - catalog_at >= CATALOG_REFRESH_S
            await _maintain_once(svc, due)
            catalog_at = loop.time() if due else catalog_at
            if down:
                log.info("redis is back")
            down = False
            backoff.reset()
            await asyncio.sleep(interval)
        except RedisError as exc:
            if not down:
                log.warning("redis unreachable: %s", exc)
            down = True
            await asyncio.sleep(backoff.next())


async def _check_redis_config(client: Redis) -> None:
    """Warn when Redis is set up to lose tasks (DESIGN: AOF on, noeviction)."""
    try:
        aof = (await client.config_get("appendonly")).get("appendonly")
        policy = (await client.config_get("maxmemory-policy")).get("maxmemory-policy")
    except (ResponseError, RedisError) as exc:
        log.info("cannot read the redis configuration (%s); not checked", exc)
        return
    if aof != "yes":
        log.warning("redis runs without appendonly: a redis restart loses queued tasks")
    if policy != "noeviction":
        log.warning("redis maxmemory-policy is %r: tasks may be evicted; use noeviction", policy)


def create_app(settings: Settings, client: Redis | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        redis = client or async_client(settings, socket_timeout=5, connect_timeout=3)
        store = TaskStore(redis, settings)
        svc = Services(
            settings=settings,
            client=redis,
            store=store,
            pool=Pool(redis, settings),
            catalog=Catalog(redis),
            auth=Authenticator(settings),
            limiter=RateLimiter(store.scripts),
            recorder=Recorder(),
            waiters=Waiters(redis, store),
        )
        app.state.services = svc
        if svc.auth.open:
            log.warning("no API keys configured: the API is open, every caller is tenant 'default'")
        if settings.catalog_on_start:
            svc.catalog.publish_configured(settings.task_modules)
        try:
            await _check_redis_config(redis)
            await svc.catalog.refresh()
            await svc.pool.snapshot()
        except RedisError as exc:
            log.warning("redis unreachable at start (%s); serving 503 until it answers", exc)
        task = asyncio.create_task(_maintain(svc), name="gpulane-maintenance")
        svc.waiters.start()
        # Everything allocated so far lives as long as the process: keep it out of the
        # cyclic collector, whose full passes over it stalled every request 70-100 ms
        # each second under load (bench/README.md).
        gc.freeze()
        try:
            yield
        finally:
            task.cancel()
            await svc.catalog.close()
            await svc.waiters.stop()
            try:
                await _flush_metrics(redis, svc.recorder)
            except RedisError:
                log.warning("could not flush the last metrics")
            if client is None:
                await redis.aclose()

    app = FastAPI(
        title="gpulane",
        version="1",
        summary="Queue-based dispatcher for a pool of GPU workers.",
        lifespan=lifespan,
        docs_url=None,  # served from the package instead of a CDN (routes/observe.py)
        # A path with a trailing slash is not a route: a JSON 404, not a 307 to
        # follow (and a POST redirected loses nothing only for clients that re-send).
        redirect_slashes=False,
    )
    install_error_handlers(app)
    for module in (tasks, results, events, queues, observe, openai, generate, usage):
        app.include_router(module.router)
    app.include_router(generate.stream_router)
    install_openapi(app, settings, lambda: _catalog_types(app))
    return app


def _catalog_types(app: FastAPI) -> dict[str, TaskTypeInfo]:
    svc: Services | None = getattr(app.state, "services", None)
    return svc.catalog.types if svc is not None else {}


def app_from_environment() -> FastAPI:
    """The app built from GPULANE_* settings: the factory each API process calls when
    `gpulane api --workers N` runs several."""
    from dispatcher.contract.logs import configure_logging
    from dispatcher.contract.settings import load_settings

    settings = load_settings()
    configure_logging(settings.log_level, settings.log_format)
    return create_app(settings)
