"""What every route depends on: the services object the app factory builds, the
caller (authentication and the tenant's rate limit), and the response headers a
request accumulates before it is answered (errors included)."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request, Response
from redis.asyncio import Redis

from dispatcher.api.auth import Authenticator, Principal
from dispatcher.api.pool import Pool
from dispatcher.api.ratelimit import RateLimiter
from dispatcher.api.store import TaskStore
from dispatcher.api.task_types import Catalog
from dispatcher.api.waiters import Waiters
from dispatcher.contract.metrics import Recorder
from dispatcher.contract.settings import Settings

__all__ = ["Services", "add_headers", "caller", "extra_headers", "services"]


@dataclass
class Services:
    settings: Settings
    client: Redis
    store: TaskStore
    pool: Pool
    catalog: Catalog
    auth: Authenticator
    limiter: RateLimiter
    recorder: Recorder
    waiters: Waiters


def services(request: Request) -> Services:
    services: Services = request.app.state.services
    return services


def extra_headers(request: Request) -> dict[str, str]:
    """Headers every response to this request carries, errors included."""
    headers: dict[str, str] = getattr(request.state, "extra_headers", {})
    return headers


def add_headers(request: Request, headers: dict[str, str]) -> None:
    request.state.extra_headers = {**extra_headers(request), **headers}


async def caller(request: Request, response: Response | None = None) -> Principal:
    """Authenticate, then take one token from the tenant's rate limit (429 when empty)."""
    svc = services(request)
    principal = svc.auth.authenticate(request.headers.get("authorization"))
    if principal.config is not None:
        verdict = await svc.limiter.take(principal.config)
        add_headers(request, verdict.headers())
        if response is not None:
            response.headers.update(verdict.headers())
        if not verdict.allowed:
            if request.method == "POST":
                svc.recorder.count("rejected", "-", "rate_limited")
            raise verdict.refusal()
    return principal
