"""A task type for the fair-share tests (``--tasks ...,gl_fair_tasks``): one that can
hold its worker, so a test can stop the pool at a known point without signals."""

from __future__ import annotations

import os
import time
from typing import Any

from pydantic import BaseModel, Field

from worker import Batch, TaskContext, task

HOLD_LIMIT_S = 60.0  # a held task gives up waiting after this (a test that died)


class GateArgs(BaseModel):
    tag: str = ""
    hold: str = Field("", description="While a file at this path exists, wait.")
    seconds: float = Field(0.0, ge=0, le=10, description="Then run this long.")


@task("test.gate")
def gate(args: GateArgs, ctx: TaskContext) -> dict[str, Any]:
    """Wait while the file ``hold`` exists, first appending ``tag`` to ``hold``.held
    (so a test sees which tasks its workers are held on), then sleep ``seconds``."""
    if args.hold and os.path.exists(args.hold):
        with open(args.hold + ".held", "a") as log:
            log.write(args.tag + "\n")
        deadline = time.monotonic() + HOLD_LIMIT_S
        while os.path.exists(args.hold) and time.monotonic() < deadline:
            time.sleep(0.005)
    time.sleep(args.seconds)
    return {"tag": args.tag}


class RunArgs(BaseModel):
    seconds: float = Field(0.01, ge=0, le=10, description="How long the task holds its device.")


# Two sizes of task as two types, as a pool runs them (an embedding item, a document
# range): fair share estimates device time per type (tests/test_device_time.py).
@task("test.small")
def small(args: RunArgs, ctx: TaskContext) -> None:
    time.sleep(args.seconds)


@task("test.large")
def large(args: RunArgs, ctx: TaskContext) -> None:
    time.sleep(args.seconds)


class SizedArgs(BaseModel):
    n: int = Field(1, ge=0, le=1000, description="The item's size (its tokens, say).")


@task("test.sized", batch=Batch(max_size=8, max_wait_ms=200, share_by="n"))
def sized(batch: list[SizedArgs], ctxs: list[TaskContext]) -> list[Any]:
    """Batched: 200 ms a call, whatever it holds; each item reports its size, by which
    the call's device time is shared (equal shares would give every item the same)."""
    time.sleep(0.2)
    return [{"n": args.n} for args in batch]
