"""Task types only the tests load (``--tasks gl_test_tasks``)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from pydantic import BaseModel, Field

from worker import TaskContext, TaskFailure, task


@task("test.env")
def env(args: BaseModel, ctx: TaskContext) -> dict[str, Any]:
    """What the process sees of its device pinning."""
    return {
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "pid": os.getpid(),
        "device": ctx.device,
    }


class FailArgs(BaseModel):
    code: str | None = None
    message: str = "boom"


@task("test.fail")
def fail(args: FailArgs, ctx: TaskContext) -> None:
    """Raise: a TaskFailure with a code when one is given, else a plain exception."""
    if args.code:
        raise TaskFailure(args.code, args.message)
    raise RuntimeError(args.message)


class SleepArgs(BaseModel):
    seconds: float = Field(1.0, ge=0)


@task("test.crash")
def crash(args: SleepArgs, ctx: TaskContext) -> None:
    """Kill the worker process outright (a segfaulting native library)."""
    time.sleep(args.seconds)
    os.kill(os.getpid(), signal.SIGKILL)


@task("test.stuck")
def stuck(args: SleepArgs, ctx: TaskContext) -> None:
    """Ignore every interrupt, like code stuck in a native call."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM, signal.SIGUSR1})
    time.sleep(args.seconds)


@task("test.poll_cancel")
def poll_cancel(args: SleepArgs, ctx: TaskContext) -> dict[str, Any]:
    """Cannot be interrupted (signals masked): stops only by polling cancelled()."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    try:
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            if ctx.cancelled():
                return {"stopped": "cooperatively"}
            time.sleep(0.01)
        return {"stopped": "at the end"}
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@task("test.flaky", retries=2)
def flaky(args: BaseModel, ctx: TaskContext) -> dict[str, Any]:
    """Fail the first attempt; the type allows retries."""
    if ctx.attempt < 2:
        raise RuntimeError(f"transient failure on attempt {ctx.attempt}")
    return {"attempt": ctx.attempt}
