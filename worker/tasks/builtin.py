"""The built-in task types: ``echo``, ``sleep`` and ``document.extract`` (its own
module, :mod:`worker.tasks.document`, registered with these)."""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from worker.registry import TaskContext, task
from worker.tasks import document
from worker.tasks.document import ExtractArgs

__all__ = ["EchoArgs", "ExtractArgs", "SleepArgs", "document"]


class EchoArgs(BaseModel):
    """Any JSON object; it comes back as the result."""

    model_config = ConfigDict(extra="allow")


@task("echo")
def echo(args: EchoArgs, ctx: TaskContext) -> dict[str, Any]:
    """Return the arguments as the result (a health check through the whole path)."""
    return args.model_dump()


class SleepArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    seconds: float = Field(1.0, ge=0, le=86_400, description="How long the task runs.")


@task("sleep")
def sleep(args: SleepArgs, ctx: TaskContext) -> dict[str, Any]:
    """Hold the worker for `seconds`, reporting progress: the synthetic GPU task."""
    if args.seconds < 0.5:  # benchmark-sized: no progress writes on the hot path
        time.sleep(args.seconds)
        return {"slept_s": args.seconds}
    start = time.monotonic()
    end = start + args.seconds
    tick = max(0.1, args.seconds / 20)
    while (left := end - time.monotonic()) > 0:
        if ctx.cancelled():
            break
        time.sleep(min(tick, left))
        done = min(1.0, (time.monotonic() - start) / args.seconds)
        ctx.progress(done, f"slept {time.monotonic() - start:.1f} of {args.seconds:g} s")
    return {"slept_s": round(time.monotonic() - start, 3)}
