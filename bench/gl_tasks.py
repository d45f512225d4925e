"""gpulane task types only the benchmarks load (``gpulane worker --tasks bench.gl_tasks``).

``bench.stamp`` is a no-op that returns the wall-clock time (``time.time()``) at which
its handler began: the bench process compares it with the moment its submit returned
(same host, same clock) to get submit->start latency without an extra Redis write.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict

from worker.registry import TaskContext, task


class StampArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")


@task("bench.stamp")
def stamp(args: StampArgs, ctx: TaskContext) -> dict[str, Any]:
    """No-op: return when the handler started (epoch seconds)."""
    return {"t": time.time()}
