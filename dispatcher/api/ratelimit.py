"""Per-tenant request rate limits: a token bucket in Redis (``ratelimit.lua``) shared
by every API replica, and the IETF draft ``RateLimit-Policy`` / ``RateLimit`` fields.

``rate`` tokens per second refill a bucket of ``burst``; every request of the tenant
takes one. Over the limit: ``429 rate_limited`` with ``Retry-After`` (whole seconds
until a token is free, at least 1). Headers (draft-ietf-httpapi-ratelimit-headers)::

    RateLimit-Policy: "tenant";q=<burst>;w=<seconds the bucket takes to fill>
    RateLimit: "tenant";r=<requests left now>;t=<seconds until the bucket is full>
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dispatcher.api.coalesce import AsyncScripts
from dispatcher.api.errors import ApiError
from dispatcher.contract.scripts import options
from dispatcher.contract.settings import TenantConfig

__all__ = ["RateLimiter", "Verdict"]


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    remaining: int
    wait_ms: int
    full_ms: int
    tenant: TenantConfig

    def headers(self) -> dict[str, str]:
        window = max(math.ceil(self.tenant.burst / self.tenant.rate), 1)
        return {
            "RateLimit-Policy": f'"tenant";q={self.tenant.burst};w={window}',
            "RateLimit": f'"tenant";r={self.remaining};t={math.ceil(self.full_ms / 1000)}',
        }

    def refusal(self) -> ApiError:
        retry = max(math.ceil(self.wait_ms / 1000), 1)
        return ApiError(
            429,
            "rate_limited",
            f"Tenant {self.tenant.name!r} is over its rate of {self.tenant.rate:g} requests/s "
            f"(burst {self.tenant.burst}); retry in {retry} s.",
            headers={**self.headers(), "Retry-After": str(retry)},
            retry_after_s=retry,
        )


class RateLimiter:
    def __init__(self, scripts: AsyncScripts) -> None:
        self.scripts = scripts

    async def take(self, tenant: TenantConfig) -> Verdict:
        opts = options(tenant=tenant.name, rate=tenant.rate, burst=tenant.burst)
        allowed, remaining, wait_ms, full_ms = await self.scripts.run("ratelimit", opts)
        return Verdict(bool(allowed), int(remaining), int(wait_ms), int(full_ms), tenant)
