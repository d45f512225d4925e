"""Test setup for the API without workers: the built-in task catalog, and tenants."""

from __future__ import annotations

import hashlib
from typing import Any

import redis

from dispatcher.contract.settings import TenantConfig
from testkit import TEST_TASKS, publish_catalog


def publish_builtin_catalog(client: redis.Redis) -> None:
    publish_catalog(client, TEST_TASKS)


def tenant(name: str, key: str, **limits: Any) -> TenantConfig:
    """A tenant whose bearer key is ``key`` (configured, as in production, by digest)."""
    return TenantConfig(name=name, key_sha256=[hashlib.sha256(key.encode()).hexdigest()], **limits)
