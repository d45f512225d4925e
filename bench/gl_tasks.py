"""gpulane task types only the benchmarks load (``gpulane worker --tasks bench.gl_tasks``).

``bench.stamp`` is a no-op that returns the wall-clock time (``time.time()``) at which
its handler began: the bench process compares it with the moment its submit returned
(same host, same clock) to get submit->start latency without an extra Redis write.

``bench.batch_noop``, ``bench.batch_vector`` and ``bench.batch_packed`` are batched (64
items): a small result, a 384-float vector as JSON numbers, or the same vector packed
as ``/v1/embeddings`` has ``embed`` return it (base64 of float32), per item: the
dispatch cost of batched inference without a model. ``bench.batch_device`` adds 2 ms
of device-like waiting per batch: the share of a worker's time its GPU would be busy.
``bench.device_embed`` is that stand-in as an embedding model ``/v1/embeddings`` serves
(``bench/device-stand-in``): the ``embed_ceiling`` scenario's card.

``bench.sleep`` holds the worker for ``seconds`` times this worker's slowdown, read
once from ``BENCH_SLOWDOWN`` (default 1; the ``mixed`` scenario starts its slow workers
with 2: a card half as fast runs every task twice as long).
"""

from __future__ import annotations

import os
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from dispatcher.contract import vectors
from worker.registry import Batch, TaskContext, task


class StampArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")


@task("bench.stamp")
def stamp(args: StampArgs, ctx: TaskContext) -> dict[str, Any]:
    """No-op: when the handler started (epoch seconds) and which worker process ran it."""
    return {"t": time.time(), "w": os.getpid()}


SLOWDOWN = float(os.environ.get("BENCH_SLOWDOWN", "1"))


class SleepArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    seconds: float = Field(ge=0, le=3600, description="Run time on a full-speed worker.")


@task("bench.sleep")
def sleep(args: SleepArgs, ctx: TaskContext) -> dict[str, Any]:
    """Sleep ``seconds`` x this worker's slowdown (``BENCH_SLOWDOWN``)."""
    time.sleep(args.seconds * SLOWDOWN)
    return {"slept_s": args.seconds * SLOWDOWN}


class ItemArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    n: int = Field(0, description="Any number; echoed by bench.batch_noop.")


@task("bench.batch_noop", batch=Batch(max_size=64, max_wait_ms=5))
def batch_noop(batch: list[ItemArgs], ctxs: list[TaskContext]) -> list[Any]:
    """Batched no-op: one small result per item (the dispatcher's cost alone)."""
    return [{"n": args.n} for args in batch]


VECTOR = [0.015625 * (i % 64) for i in range(384)]  # an embedding's size (all-MiniLM-L6-v2)


@task("bench.batch_vector", batch=Batch(max_size=64, max_wait_ms=5))
def batch_vector(batch: list[ItemArgs], ctxs: list[TaskContext]) -> list[Any]:
    """Batched: a 384-float vector per item, what an embedding returns, with no model."""
    return [{"embedding": VECTOR} for _ in batch]


PACKED = vectors.pack_floats(VECTOR)


@task("bench.batch_packed", batch=Batch(max_size=64, max_wait_ms=5))
def batch_packed(batch: list[ItemArgs], ctxs: list[TaskContext]) -> list[Any]:
    """Batched: the 384-float vector packed (base64 of little-endian float32), as
    ``embed`` returns it to ``/v1/embeddings``, with no model."""
    return [{"embedding": PACKED} for _ in batch]


DEVICE_S = 0.002  # bench.batch_device's wait per batch


@task("bench.batch_device", batch=Batch(max_size=64, max_wait_ms=5))
def batch_device(batch: list[ItemArgs], ctxs: list[TaskContext]) -> list[Any]:
    """Batched: a stand-in for a GPU's forward pass, :data:`DEVICE_S` a batch during which
    the worker's thread waits without the CPU (as on a CUDA sync), then packed vectors.
    How much of a worker's time the device would be busy, with no GPU at hand."""
    time.sleep(DEVICE_S)
    return [{"embedding": PACKED} for _ in batch]


@task("bench.long")
def long(args: SleepArgs, ctx: TaskContext) -> dict[str, Any]:
    """``bench.sleep`` under another name, for the long tasks of a mix: fair share
    estimates device time per type (the ``device`` scenario)."""
    time.sleep(args.seconds * SLOWDOWN)
    return {"slept_s": args.seconds * SLOWDOWN}


class TextArgs(BaseModel):
    """``embed``'s arguments (``worker.tasks.embed.EmbedArgs``), not imported: that
    module registers ``embed`` in every worker that imports it."""

    model_config = ConfigDict(extra="forbid")

    text: str = Field(min_length=1, max_length=8192, description="Ignored but for its length.")


DEVICE_MODEL = "bench/device-stand-in"
DEVICE_TYPE = "bench.device_embed"


@task(
    DEVICE_TYPE,
    model=DEVICE_MODEL,
    batch=Batch(max_size=64, max_wait_ms=5),
    description="An embedding model at GPU speed with no GPU: bench.batch_device's wait.",
)
def device_embed(batch: list[TextArgs], ctxs: list[TaskContext]) -> list[Any]:
    """``/v1/embeddings`` served at a card's speed: :data:`DEVICE_S` a batch of waiting
    without the CPU, then a packed vector per text. What the dispatch path sustains
    when the model's time has left the CPU."""
    time.sleep(DEVICE_S)
    return [{"embedding": PACKED, "tokens": len(a.text.split()) + 2} for a in batch]
