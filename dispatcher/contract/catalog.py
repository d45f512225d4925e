"""The configured task catalog, learnt from a short subprocess of worker code.

The dispatcher never imports task code. To know the types a deployment is configured
to run before any worker starts (a fresh Redis, workers still loading models, a pool
scaled to zero), the API at start and ``gpulane catalog`` run ``python -m
worker.describe <task_modules>`` with CUDA hidden and publish what it prints into
``gpulane:catalog``, exactly as a registering worker does (HSET per type; entries
persist). Workers still publish their own types when they register.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

__all__ = ["CatalogError", "catalog_command", "parse_catalog"]


class CatalogError(RuntimeError):
    """The task modules could not be loaded or printed no catalog; the message says why."""


def catalog_command(modules: list[str]) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of the catalog subprocess (CUDA hidden)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return [sys.executable, "-m", "worker.describe", *modules], env


def parse_catalog(returncode: int, stdout: bytes, stderr: bytes) -> dict[str, str]:
    """``{type: entry JSON}`` for HSET into ``gpulane:catalog``, or CatalogError."""
    if returncode != 0:
        why = stderr.decode(errors="replace").strip().splitlines()
        raise CatalogError(why[-1] if why else f"the catalog subprocess exited {returncode}")
    lines = stdout.decode(errors="replace").strip().splitlines()
    try:
        catalog: Any = json.loads(lines[-1])
    except (IndexError, ValueError) as exc:
        raise CatalogError(f"the catalog subprocess printed no catalog ({exc})") from exc
    if not isinstance(catalog, dict):
        raise CatalogError("the catalog subprocess printed no JSON object")
    return {str(name): json.dumps(entry) for name, entry in catalog.items()}
