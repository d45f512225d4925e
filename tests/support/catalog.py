"""Test setup for the API without workers: the built-in task catalog, and tenants."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import redis

from dispatcher import keys
from dispatcher.settings import TenantConfig


def publish_builtin_catalog(client: redis.Redis) -> None:
    import gl_test_tasks  # noqa: F401 - registers the test task types

    import worker.tasks.builtin  # noqa: F401 - registers the built-ins
    from worker.registry import REGISTRY

    for name, entry in REGISTRY.catalog().items():
        client.hset(keys.CATALOG, name, json.dumps(entry))


def tenant(name: str, key: str, **limits: Any) -> TenantConfig:
    """A tenant whose bearer key is ``key`` (configured, as in production, by digest)."""
    return TenantConfig(name=name, key_sha256=[hashlib.sha256(key.encode()).hexdigest()], **limits)
