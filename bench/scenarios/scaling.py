"""Scenario 3, scaling: throughput on N = 1, 2, 4, 8 workers against N x one worker.

One ``redis-server``; ``gpulane worker`` processes are added between steps (1, then
2, 4, 8 running). Each step fills the shared queue with equal ``sleep`` tasks
(50 ms, no CPU: eight workers really run in parallel on two cores) faster than the
workers drain it, then measures tasks per second between the first start and the last
end (Redis clock). Efficiency is X(N) / (N x X(1)); anything below 1 is coordination
cost: the gap between one task's end and the worker's next start, contention on Redis
or on the CPU.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.glside import Submitter, gl_done, records
from bench.harness import Stack, wait_for
from bench.report import Report, Table, Target, figure, save

CLASSES = ["interactive", "batch"]


@dataclass(frozen=True)
class Size:
    per_worker: int  # tasks per worker in each step
    counts: tuple[int, ...] = (1, 2, 4, 8)
    task_s: float = 0.05


SIZES = {
    "smoke": Size(per_worker=8, counts=(1, 2), task_s=0.02),
    "quick": Size(per_worker=60),
    "full": Size(per_worker=400),
}


def _step(stack: Stack, submitter: Submitter, n_workers: int, size: Size) -> dict[str, Any]:
    client = stack.client()
    ids = submitter.fill(size.per_worker * n_workers, "sleep", {"seconds": size.task_s}, "batch")
    limit = 30 + 3 * size.per_worker * size.task_s
    wait_for(lambda: gl_done(client, ids), limit, "the queue to drain", every_s=0.05)
    rows = records(client, ids)
    first = min(r["started_ms"] for r in rows)
    last = max(r["ended_ms"] for r in rows)
    return {
        "workers": n_workers,
        "tasks": len(ids),
        "rate": len(ids) / ((last - first) / 1000),
        "gap_ms": _gaps(rows),
        "run_ms": float(np.mean([r["ended_ms"] - r["started_ms"] for r in rows])),
    }


def _gaps(rows: list[dict[str, Any]]) -> float:
    """Median time a worker spent between one task's end and its next start (ms)."""
    by_worker: dict[str, list[tuple[int, int]]] = {}
    for r in rows:
        by_worker.setdefault(r["worker"], []).append((r["started_ms"], r["ended_ms"]))
    gaps = []
    for spans in by_worker.values():
        spans.sort()
        gaps += [b[0] - a[1] for a, b in itertools.pairwise(spans)]
    return float(np.median(gaps)) if gaps else float("nan")


def measure(size: Size) -> list[dict[str, Any]]:
    steps = []
    with Stack() as stack:
        submitter = Submitter(stack.client(), CLASSES)
        running = 0
        for n in size.counts:
            procs = [stack.gpulane_worker(f"s{i}", wait=False) for i in range(running, n)]
            for proc in procs:
                stack.wait_registered(proc)
            running = n
            submitter.workers = n
            steps.append(_step(stack, submitter, n, size))
    return steps


def run(size: str, outdir: Path) -> Report:
    cfg = SIZES[size]
    steps = measure(cfg)
    one = steps[0]["rate"]
    report = Report("scaling", size)
    rows = []
    for s in steps:
        s["efficiency"] = s["rate"] / (s["workers"] * one)
        rows.append(
            [
                s["workers"],
                s["tasks"],
                s["rate"],
                s["workers"] * one,
                s["efficiency"],
                s["run_ms"],
                s["gap_ms"],
            ]
        )
    report.tables.append(
        Table(
            f"Throughput on N workers, saturated queue of {cfg.task_s * 1000:.0f} ms tasks",
            [
                "N",
                "tasks",
                "tasks/s",
                "N x one worker",
                "efficiency",
                "mean run ms",
                "median end->next start ms",
            ],
            rows,
            f"Ceiling per worker without any overhead: {1 / cfg.task_s:.1f} tasks/s.",
        )
    )
    for s in steps:
        goal = {4: 0.97, 8: 0.95}.get(s["workers"])
        if goal is not None:
            report.targets.append(
                Target(
                    f"throughput on {s['workers']} workers, equal tasks, saturated",
                    f"{s['workers']} x one worker = {s['workers'] * one:.1f}/s",
                    f">= {goal:.2f} N",
                    f"{s['efficiency']:.3f} N",
                    s["efficiency"] >= goal,
                )
            )
    report.charts.append(_chart(steps, outdir))
    report.write(outdir)
    return report


def _chart(steps: list[dict[str, Any]], outdir: Path) -> str:
    fig, (left, right) = figure(9.0, 3.4, ncols=2)
    ns = [s["workers"] for s in steps]
    left.plot(ns, [s["rate"] for s in steps], "o-", label="measured")
    left.plot(ns, [n * steps[0]["rate"] for n in ns], "--", label="N x one worker")
    left.set_xlabel("workers")
    left.set_ylabel("tasks / s")
    left.set_title("Throughput")
    left.legend()
    right.plot(ns, [s["efficiency"] for s in steps], "o-")
    right.axhline(0.95, color="grey", linestyle=":")
    right.set_ylim(0.8, 1.05)
    right.set_xlabel("workers")
    right.set_ylabel("efficiency")
    right.set_title("Efficiency X(N) / (N X(1))")
    return save(fig, outdir, "scaling.png")
