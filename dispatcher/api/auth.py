"""Who is calling: tenants and their bearer keys.

Keys are configured as SHA-256 digests (``key_sha256``), never in clear. A presented
key is hashed and compared with every configured digest in constant time, without
stopping at the first match, so timing tells nothing about which keys exist. With no
tenants configured the API is open: every caller is tenant ``default`` with admin
rights, and the API warns at start.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Any

from dispatcher.api.errors import ApiError
from dispatcher.contract.settings import Settings, TenantConfig

__all__ = ["OPEN_TENANT", "Authenticator", "Principal"]

OPEN_TENANT = "default"
_MAX_KEY_LENGTH = 512


@dataclass(frozen=True)
class Principal:
    tenant: str
    admin: bool
    config: TenantConfig | None = None

    def may_use(self, cls: str) -> bool:
        return self.config is None or self.config.classes is None or cls in self.config.classes

    def terms(self) -> dict[str, Any]:
        """What a Submission carries of the tenant's configuration (its quota, weight
        and device quota; none without a configuration)."""
        cfg = self.config
        if cfg is None:
            return {}
        return {
            "max_in_flight": cfg.max_in_flight,
            "weight": cfg.weight,
            "device_quota_s": cfg.device_seconds_per_hour or 0.0,
        }

    @property
    def task_scope(self) -> str | None:
        """Tenant whose tasks this caller may see; None for admins (all tasks)."""
        return None if self.admin else self.tenant


def _unauthorized(message: str) -> ApiError:
    return ApiError(
        401, "unauthorized", message, headers={"WWW-Authenticate": 'Bearer realm="gpulane"'}
    )


class Authenticator:
    def __init__(self, settings: Settings) -> None:
        self.open = not settings.tenants
        self._keys = [
            (bytes.fromhex(digest), tenant)
            for tenant in settings.tenants
            for digest in tenant.key_sha256
        ]

    def authenticate(self, authorization: str | None) -> Principal:
        if self.open:
            return Principal(OPEN_TENANT, admin=True)
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise _unauthorized("This API needs an 'Authorization: Bearer <key>' header.")
        key = key.strip()
        if len(key) > _MAX_KEY_LENGTH:
            raise _unauthorized("The API key is not valid.")
        digest = hashlib.sha256(key.encode()).digest()
        found: TenantConfig | None = None
        for candidate, tenant in self._keys:
            if hmac.compare_digest(candidate, digest) and found is None:
                found = tenant
        if found is None:
            raise _unauthorized("The API key is not valid.")
        return Principal(found.name, found.admin, found)
