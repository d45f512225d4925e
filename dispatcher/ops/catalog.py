"""``gpulane catalog``: publish the configured task types before any worker runs.

A deploy step (or an init container) for pools whose API runs without the task
modules' dependencies, or with ``catalog_on_start`` off: it runs ``python -m
worker.describe`` with CUDA hidden and writes each type into ``gpulane:catalog``, as a
registering worker does.
"""

from __future__ import annotations

import json
import subprocess
import sys

from redis.exceptions import RedisError

from dispatcher.contract import keys
from dispatcher.contract.catalog import CatalogError, catalog_command, parse_catalog
from dispatcher.contract.connect import sync_client
from dispatcher.contract.exits import EXIT_FAILED, EXIT_OK, EXIT_UNAVAILABLE
from dispatcher.contract.settings import Settings

__all__ = ["publish_catalog"]

TIMEOUT_S = 300.0


def publish_catalog(settings: Settings, modules: list[str], print_only: bool) -> int:
    argv, env = catalog_command(modules)
    try:
        done = subprocess.run(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=TIMEOUT_S,
            check=False,
        )
        entries = parse_catalog(done.returncode, done.stdout, done.stderr)
    except (CatalogError, subprocess.TimeoutExpired) as exc:
        print(f"gpulane catalog: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if print_only:
        print(json.dumps({k: json.loads(v) for k, v in entries.items()}, indent=2))
        return EXIT_OK
    client = sync_client(settings, socket_timeout=10, connect_timeout=3)
    try:
        if entries:
            client.hset(keys.CATALOG, mapping=entries)  # type: ignore[arg-type]
    except RedisError as exc:
        print(f"gpulane catalog: redis unavailable: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    finally:
        client.close()
    print(f"gpulane catalog: published {', '.join(sorted(entries)) or 'no types'}")
    return EXIT_OK
