"""Scenario 7, recovery: a worker is SIGKILLed mid-task; how long until the task runs
again on another worker.

gpulane with default settings (heartbeat 1 s, lease 3 s): one worker takes a long
``sleep`` task, a second worker joins, the first is SIGKILLed, and the time from the
kill to the task's next start (Redis clock, same host) is measured, ``runs`` times.

Plain RQ ``SimpleWorker`` (the only RQ worker that keeps a model loaded) with default
settings and the JSON serializer, the job enqueued with ``Retry(max=1)`` (without a
retry RQ never runs an abandoned job again): same measurement. RQ sends no heartbeat
while a job runs and notices an abandoned job only when a worker's maintenance pass
cleans its started-job registry, every 10 minutes by default, so this side takes
about 15 minutes and runs only at full size.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rq import Queue, Retry
from rq.serializers import JSONSerializer

from bench.glside import Submitter, records
from bench.harness import Stack
from bench.report import Report, Table, axes, figure, judged, save
from testkit import wait_for

CLASSES = ["interactive", "batch"]
RQ_LIMIT_S = 1800.0


@dataclass(frozen=True)
class Size:
    runs: int
    with_rq: bool


SIZES = {
    "smoke": Size(runs=1, with_rq=False),
    "quick": Size(runs=3, with_rq=False),
    "full": Size(runs=5, with_rq=True),
}


def _gpulane_once(run: int) -> float:
    with Stack() as stack:
        client = stack.client()
        first = stack.gpulane_worker(f"first-{run}")
        task = Submitter(client, CLASSES).submit("sleep", {"seconds": 120}, "batch")
        wait_for(lambda: records(client, [task])[0]["worker"] == first.name, 30, "the start")
        second = stack.gpulane_worker(f"second-{run}")
        os.kill(first.pid, signal.SIGKILL)
        killed = time.time()

        def moved() -> bool:
            return bool(records(client, [task])[0]["worker"] == second.name)

        wait_for(moved, 60, "the task to start again", interval_s=0.02)
        return float(records(client, [task])[0]["started_ms"]) / 1000 - killed


def _rq_once() -> float | None:
    with Stack() as stack:
        client = stack.client()
        first = stack.rq_worker("rq-first", "default")
        job = Queue("default", connection=client, serializer=JSONSerializer).enqueue(
            "bench.rq_tasks.slow", 3600, retry=Retry(max=1)
        )
        starts = f"starts:{job.id}"
        wait_for(lambda: client.llen(starts) >= 1, 60, "the RQ job to start")
        stack.rq_worker("rq-second", "default")
        os.kill(first.pid, signal.SIGKILL)
        killed = time.time()
        deadline = killed + RQ_LIMIT_S
        while client.llen(starts) < 2 and time.time() < deadline:
            time.sleep(0.5)
        second = client.lindex(starts, 1)
        if second is None:
            return None
        text = second.decode() if isinstance(second, bytes) else str(second)
        return float(text.split(":")[0]) - killed


def run(size: str, outdir: Path) -> Report:
    cfg = SIZES[size]
    gl = [_gpulane_once(i) for i in range(cfg.runs)]
    rq = _rq_once() if cfg.with_rq else None
    report = Report("recovery", size)
    gl_label = "gpulane, defaults (heartbeat 1 s, lease 3 s)"
    rows: list[list[Any]] = [[gl_label, len(gl), min(gl), sorted(gl)[len(gl) // 2], max(gl)]]
    if cfg.with_rq:
        shown = rq if rq is not None else f"> {RQ_LIMIT_S:.0f}"
        rows.append(["plain RQ SimpleWorker, defaults, Retry(max=1)", 1, shown, shown, shown])
    report.tables.append(
        Table(
            "Seconds from SIGKILL of the worker to the task starting on another worker",
            "system | runs | min s | median s | max s",
            rows,
            "The RQ side runs at full size only (about 15 minutes): RQ reclaims an abandoned "
            "job on a worker's maintenance pass, every 10 minutes by default.",
        )
    )
    baseline = f"plain RQ: > {RQ_LIMIT_S:.0f} s" if cfg.with_rq else "plain RQ: full size only"
    if rq is not None:
        baseline = f"plain RQ defaults: {rq:.0f} s"
    worst = f"{max(gl):.2f} s (worst of {len(gl)})"
    report.targets.append(
        judged(
            "SIGKILLed worker's task running again elsewhere", baseline, max(gl), "<= 5 s", worst
        )
    )
    report.charts.append(_chart(gl, rq, outdir))
    report.write(outdir)
    return report


def _chart(gl: list[float], rq: float | None, outdir: Path) -> str:
    fig, axis = figure(6.0, 2.6)
    labels = ["gpulane"] + (["plain RQ"] if rq is not None else [])
    values = [max(gl)] + ([rq] if rq is not None else [])
    axis.barh(labels, values)
    x = "seconds until the killed worker's task runs again (log scale)"
    axes(axis, "Recovery after SIGKILL", x, xscale="log")
    return save(fig, outdir, "recovery.png")
