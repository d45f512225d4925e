"""gpulane task types only the benchmarks load (``gpulane worker --tasks bench.gl_tasks``).

``bench.stamp`` is a no-op that returns the wall-clock time (``time.time()``) at which
its handler began: the bench process compares it with the moment its submit returned
(same host, same clock) to get submit->start latency without an extra Redis write.

``bench.sleep`` holds the worker for ``seconds`` times this worker's slowdown, read
once from ``BENCH_SLOWDOWN`` (default 1; the ``mixed`` scenario starts its slow workers
with 2: a card half as fast runs every task twice as long).
"""

from __future__ import annotations

import os
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from worker.registry import TaskContext, task


class StampArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")


@task("bench.stamp")
def stamp(args: StampArgs, ctx: TaskContext) -> dict[str, Any]:
    """No-op: return when the handler started (epoch seconds)."""
    return {"t": time.time()}


SLOWDOWN = float(os.environ.get("BENCH_SLOWDOWN", "1"))


class SleepArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    seconds: float = Field(ge=0, le=3600, description="Run time on a full-speed worker.")


@task("bench.sleep")
def sleep(args: SleepArgs, ctx: TaskContext) -> dict[str, Any]:
    """Sleep ``seconds`` x this worker's slowdown (``BENCH_SLOWDOWN``)."""
    time.sleep(args.seconds * SLOWDOWN)
    return {"slept_s": args.seconds * SLOWDOWN}
