"""Plain-RQ job functions for the baseline (``rq worker -w rq.worker.SimpleWorker``).

``stamp`` mirrors :func:`bench.gl_tasks.stamp`: a no-op returning the wall-clock time
its body began, so both systems are timed the same way.
"""

from __future__ import annotations

import os
import time
from typing import Any


def stamp() -> dict[str, Any]:
    """No-op: when the function started (epoch seconds) and which worker process ran it."""
    return {"t": time.time(), "w": os.getpid()}


def slow(seconds: float) -> str:
    """Record each start of this job (epoch seconds, pid) in ``starts:<job id>``, then
    sleep: the recovery scenario counts the starts."""
    from rq import get_current_job

    job = get_current_job()
    assert job is not None
    job.connection.rpush(f"starts:{job.id}", f"{time.time()}:{os.getpid()}")
    time.sleep(seconds)
    return "done"
