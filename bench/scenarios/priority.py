"""Scenario 6, priority: interactive waits while ``batch`` is flooded.

1,000 ``batch`` tasks (``sleep``, no CPU) are queued at once on 4 workers while a
client submits ``interactive`` tasks at a steady pace until the flood has drained.
Two pools, each on its own Redis, in one run:

- shared: 4 workers serving ``interactive,batch`` (interactive is always taken first,
  so it waits only for the first worker to finish its current batch task);
- reserved: 1 worker started with ``--classes interactive`` plus 3 shared ones (an
  interactive task starts at once unless more than one arrives per task length).

Reports the interactive queue wait (started - created, Redis clock) p50 / p99 / max,
and the batch flood's makespan, which is what reserving a worker costs.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.glside import Submitter, gl_done, records
from bench.harness import Stack
from bench.report import Report, Table, axes, cdf, figure, judged, p50_p99, save
from testkit import wait_for

CLASSES = ["interactive", "batch"]
CELLS = ("pool", "interactive", "p50_ms", "p99_ms", "max_ms", "makespan_s")  # table row
POOLS = {"shared": 0, "reserved": 1}  # name -> workers serving interactive only


@dataclass(frozen=True)
class Size:
    batch: int
    batch_s: float  # each batch task's length
    interactive_s: float
    every_s: float  # pace of interactive submissions
    workers: int = 4


SIZES = {
    "smoke": Size(batch=40, batch_s=0.05, interactive_s=0.01, every_s=0.05),
    "quick": Size(batch=1000, batch_s=0.04, interactive_s=0.01, every_s=0.1),
    "full": Size(batch=1000, batch_s=0.2, interactive_s=0.05, every_s=0.25),
}


def _pace(submitter: Submitter, size: Size, stop: threading.Event, ids: list[str]) -> None:
    while not stop.wait(size.every_s):
        ids.append(submitter.submit("sleep", {"seconds": size.interactive_s}, "interactive"))


def _pool(name: str, reserved: int, size: Size) -> dict[str, Any]:
    with Stack() as stack:
        for i in range(size.workers):
            serve = ["interactive"] if i < reserved else CLASSES
            stack.gpulane_worker(f"{name}-{i}", serve=serve)
        client = stack.client()
        submitter = Submitter(client, CLASSES, workers=size.workers)
        batch = submitter.fill(size.batch, "sleep", {"seconds": size.batch_s}, "batch")
        interactive: list[str] = []
        stop = threading.Event()
        pacer = threading.Thread(
            target=_pace, args=(Submitter(stack.client(), CLASSES), size, stop, interactive)
        )
        pacer.start()
        limit = 60 + 2 * size.batch * size.batch_s / (size.workers - reserved)
        wait_for(lambda: gl_done(client, batch), limit, "the batch flood to drain", interval_s=0.1)
        stop.set()
        pacer.join()
        wait_for(lambda: gl_done(client, interactive), 30, "interactive tasks", interval_s=0.05)
        flood = records(client, batch)
        waits = [(r["started_ms"] - r["created_ms"]) for r in records(client, interactive)]
    p50, p99 = p50_p99(waits)
    makespan_ms = max(r["ended_ms"] for r in flood) - min(r["created_ms"] for r in flood)
    return {"pool": name, "interactive": len(waits), "p50_ms": p50, "p99_ms": p99,
            "max_ms": max(waits), "waits": waits, "makespan_s": makespan_ms / 1000}  # fmt: skip


def run(size: str, outdir: Path) -> Report:
    cfg = SIZES[size]
    started = time.monotonic()
    rows = [_pool(name, reserved, cfg) for name, reserved in POOLS.items()]
    report = Report("priority", size)
    report.tables.append(
        Table(
            f"Interactive wait during a flood of {cfg.batch} batch tasks "
            f"({cfg.batch_s * 1000:.0f} ms each) on {cfg.workers} workers",
            "pool | interactive tasks | wait p50 ms | wait p99 ms | wait max ms | batch makespan s",
            [[r[k] for k in CELLS] for r in rows],
            f"One interactive task ({cfg.interactive_s * 1000:.0f} ms) every "
            f"{cfg.every_s * 1000:.0f} ms until the flood drained. shared: every worker serves "
            "both classes (interactive first); reserved: one of them serves only interactive. "
            "Wait = started - created on the Redis clock. "
            f"Ran {time.monotonic() - started:.0f} s.",
        )
    )
    shared = rows[0]
    batch_ms = cfg.batch_s * 1000
    report.targets.append(
        judged("interactive p99 wait under a batch flood, shared pool",
               f"one batch task: {batch_ms:.0f} ms", shared["p99_ms"] / batch_ms,
               "<= 1.5 x one batch task", f"{shared['p99_ms']:.0f} ms")
    )  # fmt: skip
    report.charts.append(_chart(rows, outdir))
    report.write(outdir)
    return report


def _chart(rows: list[dict[str, Any]], outdir: Path) -> str:
    fig, axis = figure(6.0, 3.4)
    for r in rows:
        cdf(axis, r["waits"], label=r["pool"])
    axes(axis, "Interactive wait during a batch flood", "interactive queue wait (ms)",
         "fraction of tasks", legend=10)  # fmt: skip
    return save(fig, outdir, "priority.png")
