"""Plain-RQ job functions for the baseline (``rq worker -w rq.worker.SimpleWorker``).

``stamp`` mirrors :func:`bench.gl_tasks.stamp`: a no-op returning the wall-clock time
its body began, so both systems are timed the same way.
"""

from __future__ import annotations

import time
from typing import Any


def stamp() -> dict[str, Any]:
    """No-op: return when the function started (epoch seconds)."""
    return {"t": time.time()}
