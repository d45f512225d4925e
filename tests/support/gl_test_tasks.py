"""Task types only the tests load (``--tasks gl_test_tasks``)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from pydantic import BaseModel, Field

from worker import Batch, TaskContext, TaskFailure, task


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


# Exceptions shaped like the GPU stack's: the worker recognises them by class name,
# module and message, as it would torch's (it never imports torch itself).
AcceleratorError = type("AcceleratorError", (RuntimeError,), {"__module__": "torch"})
OutOfMemoryError = type("OutOfMemoryError", (RuntimeError,), {"__module__": "torch"})


class FaultArgs(BaseModel):
    kind: str = Field("illegal_address", pattern="^(illegal_address|oom)$")
    until_attempt: int = Field(1, ge=0, description="Fault on attempts up to this one.")


def _fake_torch() -> Any:
    """A `torch` in sys.modules whose cuda.empty_cache() counts its calls, as if the
    task code had imported torch (the worker frees cached memory only then)."""
    import sys
    import types

    torch: Any = sys.modules.get("torch")
    if torch is None:
        torch = types.ModuleType("torch")
        torch.empty_cache_calls = 0

        def empty_cache() -> None:
            torch.empty_cache_calls += 1

        torch.cuda = types.SimpleNamespace(empty_cache=empty_cache)
        sys.modules["torch"] = torch
    return torch


@task("test.cuda_fault")
def cuda_fault(args: FaultArgs, ctx: TaskContext) -> dict[str, Any]:
    """Raise a fatal CUDA error (or a CUDA out-of-memory) on the first attempts."""
    _fake_torch()
    if ctx.attempt <= args.until_attempt:
        if args.kind == "oom":
            raise OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity "
                "of 79.19 GiB of which 3.12 GiB is free."
            )
        raise AcceleratorError(
            "CUDA error: an illegal memory access was encountered\nCUDA kernel errors might "
            "be asynchronously reported at some other API call, so the stacktrace below "
            "might be incorrect."
        )
    return {"attempt": ctx.attempt, "device": ctx.device}


@task("test.torch_stats")
def torch_stats(args: BaseModel, ctx: TaskContext) -> dict[str, Any]:
    """How often the worker emptied the (fake) torch CUDA cache."""
    return {"empty_cache_calls": _fake_torch().empty_cache_calls}


class RecordArgs(BaseModel):
    path: str
    tag: str
    seconds: float = Field(0.0, ge=0, le=60)


@task("test.record")
def record(args: RecordArgs, ctx: TaskContext) -> None:
    """After ``seconds``, append ``tag`` to the file at ``path``: the order tasks really
    ran in (or ended: one line per run), which tests assert instead of comparing clock
    readings (milliseconds tie)."""
    time.sleep(args.seconds)
    with open(args.path, "a") as log:
        log.write(args.tag + "\n")


class HogArgs(BaseModel):
    mb: int = Field(1, ge=1, le=4096)


_HELD: list[bytes] = []  # what test.hog leaves behind, as a leaky task would


@task("test.hog")
def hog(args: HogArgs, ctx: TaskContext) -> dict[str, Any]:
    """Allocate ``mb`` MiB (touched, so resident) and keep it after the task ends."""
    _HELD.append(b"\x01" * (args.mb * 1024 * 1024))
    return {"pid": os.getpid(), "held_mb": sum(len(b) for b in _HELD) // (1024 * 1024)}


class StepsArgs(BaseModel):
    steps: int = Field(3, ge=1, le=100)
    step_s: float = Field(0.3, ge=0, le=10)


@task("test.steps")
def steps(args: StepsArgs, ctx: TaskContext) -> dict[str, Any]:
    """Report progress after each of ``steps`` sleeps of ``step_s`` (keep ``step_s``
    above the worker's 0.25 s progress throttle to see every step)."""
    for index in range(args.steps):
        time.sleep(args.step_s)
        ctx.progress((index + 1) / args.steps, f"step {index + 1} of {args.steps}")
    return {"steps": args.steps}


class BatchEchoArgs(BaseModel):
    value: int
    path: str = ""
    seconds: float = Field(0.0, ge=0, le=60)
    fail: bool = False


@task("test.batch_echo", batch=Batch(max_size=4, max_wait_ms=20))
def batch_echo(batch: list[BatchEchoArgs], ctxs: list[TaskContext]) -> list[Any]:
    """Batched: appends the batch's values (one line per call) to the first item's
    ``path``, sleeps the longest ``seconds`` once, and echoes each value; an item with
    ``fail`` fails alone."""
    if batch[0].path:
        with open(batch[0].path, "a") as log:
            log.write(" ".join(str(args.value) for args in batch) + "\n")
    time.sleep(max(args.seconds for args in batch))
    return [
        TaskFailure("bad_item", f"item {args.value} fails") if args.fail else {"value": args.value}
        for args in batch
    ]


class BigArgs(BaseModel):
    seconds: float = Field(0.0, ge=0, le=60)


@task("test.big", gpu_memory_mb=30_000)
def big(args: BigArgs, ctx: TaskContext) -> dict[str, Any]:
    """Declares 30,000 MB of GPU memory: placement tests see where it runs."""
    time.sleep(args.seconds)
    return {"pid": os.getpid()}


class MapArgs(BaseModel):
    parts: int = Field(3, ge=1, le=2000)
    seconds: float = Field(0.0, ge=0, le=60)  # each part's run
    fail_part: int | None = None  # this part fails (task_failure)
    path: str = ""  # each part's run appends "<index>" here
    flatten: bool = False


@task("test.map")
def map_parts(args: MapArgs, ctx: TaskContext) -> Any:
    """Split into ``parts`` parts of ``test.part`` (ctx.map): the fan-out under test."""
    items = [
        {"index": i, "seconds": args.seconds, "fail": i == args.fail_part, "path": args.path}
        for i in range(args.parts)
    ]
    return ctx.map(
        "test.part",
        items,
        into="values",
        flatten=args.flatten,
        result={"parts": args.parts, "workers": ctx.workers()},
    )


class PartArgs(BaseModel):
    index: int
    seconds: float = 0.0
    fail: bool = False
    path: str = ""


@task("test.part")
def part(args: PartArgs, ctx: TaskContext) -> Any:
    """One part of test.map: sleeps (with progress), records its run, returns its
    index and a list of two entries (what flatten concatenates)."""
    if args.path:
        with open(args.path, "a") as log:
            log.write(f"{args.index}\n")
    start = time.monotonic()
    while (left := args.seconds - (time.monotonic() - start)) > 0:
        time.sleep(min(0.1, left))
        ctx.progress(min(1.0, (time.monotonic() - start) / args.seconds))
    if args.fail:
        raise TaskFailure("part_broke", f"part {args.index} broke")
    return {"index": args.index, "parent": ctx.parent, "values": [args.index, -args.index]}
