"""The benchmark scenarios. Each module has ``SIZES`` (``smoke``, ``quick``, ``full``)
and ``run(size, outdir) -> Report``, and starts and stops everything it uses."""

from __future__ import annotations

SCENARIOS = (
    "overhead",
    "balancing",
    "mixed",
    "scaling",
    "api",
    "memory",
    "priority",
    "recovery",
    "latency",
    "embed",
    "fair",
    "batched",
    "embed_api",
    "generate",
    "device",
    "documents",
    "cpu_share",
    "embed_ceiling",
)
