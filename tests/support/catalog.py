"""Publish the built-in task catalog without a worker, for API tests that need types
known but no worker to run them."""

from __future__ import annotations

import json

import redis

from dispatcher import keys


def publish_builtin_catalog(client: redis.Redis) -> None:
    import gl_test_tasks  # noqa: F401 - registers the test task types

    import worker.tasks.builtin  # noqa: F401 - registers the built-ins
    from worker.registry import REGISTRY

    for name, entry in REGISTRY.catalog().items():
        client.hset(keys.CATALOG, name, json.dumps(entry))
