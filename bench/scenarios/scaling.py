"""Scenario 3, scaling: throughput on N = 1, 2, 4, 8 workers against N x one worker.

One ``redis-server`` and eight ``gpulane worker`` processes, started once. Each step
uses its own class queue served by exactly N of them (worker k serves the classes of
every step with N > k), so steps can run in any order: they run interleaved
(1, 2, 4, 8, 1, 8, 4, 2, 1, ...) and each N is compared with the one-worker steps
around it, which cancels most of the drift of a shared machine. A step fills its
queue with equal ``sleep`` tasks (50 ms, no CPU: eight workers really run in
parallel on two cores) faster than the workers drain it, then measures tasks per
second between the first start and the last end (Redis clock). Efficiency is
X(N) / (N x X(1)); anything below 1 is coordination cost: the gap between one task's
end and the worker's next start, contention on Redis or on the CPU. Rates are taken
per worker while it is saturated (see the table note), so a short run's edges do not
count as scaling loss.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.glside import Submitter, gl_done, records
from bench.harness import Stack, classes_json
from bench.report import Report, Table, axes, figure, judged, save
from testkit import wait_for


@dataclass(frozen=True)
class Size:
    per_worker: int  # tasks per worker in each step
    rounds: int  # each round runs every N once, in alternating order
    counts: tuple[int, ...] = (1, 2, 4, 8)
    task_s: float = 0.05

    def order(self) -> list[int]:
        """1, 2, 4, 8, 1, 8, 4, 2, 1...: every N between one-worker steps, both ways."""
        steps = [1]
        for r in range(self.rounds):
            others = [n for n in self.counts if n != 1]
            steps += (others if r % 2 == 0 else others[::-1]) + [1]
        return steps


SIZES = {
    "smoke": Size(per_worker=6, rounds=1, counts=(1, 2), task_s=0.02),
    "quick": Size(per_worker=30, rounds=2),
    "full": Size(per_worker=200, rounds=4),
}


def step_class(n: int) -> str:
    return f"n{n}"


def _step(stack: Stack, submitter: Submitter, n_workers: int, size: Size) -> dict[str, Any]:
    client = stack.client()
    cls = step_class(n_workers)
    ids = submitter.fill(size.per_worker * n_workers, "sleep", {"seconds": size.task_s}, cls)
    limit = 30 + 3 * size.per_worker * size.task_s
    wait_for(lambda: gl_done(client, ids), limit, "the queue to drain", interval_s=0.05)
    rows = records(client, ids)
    first = min(r["started_ms"] for r in rows)
    last = max(r["ended_ms"] for r in rows)
    by_worker: dict[str, list[tuple[int, int]]] = {}
    for r in rows:
        by_worker.setdefault(r["worker"], []).append((r["started_ms"], r["ended_ms"]))
    return {
        "workers": n_workers,
        "tasks": len(ids),
        "rate": sum(_worker_rate(spans) for spans in by_worker.values()),
        "span_rate": len(ids) / ((last - first) / 1000),
        "gap_ms": _gaps(by_worker),
        "run_ms": float(np.mean([r["ended_ms"] - r["started_ms"] for r in rows])),
    }


def _worker_rate(spans: list[tuple[int, int]]) -> float:
    """One worker's tasks per second while saturated: start of its first task to start
    of its last (free of the staggered start and the uneven tail of a short run)."""
    starts = sorted(start for start, _ in spans)
    return (len(starts) - 1) / ((starts[-1] - starts[0]) / 1000) if len(starts) > 1 else 0.0


def _gaps(by_worker: dict[str, list[tuple[int, int]]]) -> float:
    """Median time a worker spent between one task's end and its next start (ms)."""
    gaps = []
    for spans in by_worker.values():
        spans.sort()
        gaps += [b[0] - a[1] for a, b in itertools.pairwise(spans)]
    return float(np.median(gaps)) if gaps else float("nan")


def measure(size: Size) -> list[dict[str, Any]]:
    """Every step, in the interleaved order, on workers started once."""
    classes = [step_class(n) for n in size.counts]
    steps = []
    with Stack() as stack:
        config = {"classes": classes_json(classes), "default_class": classes[0]}
        procs = []
        for k in range(max(size.counts)):
            serve = [step_class(n) for n in size.counts if n > k]
            procs.append(stack.gpulane_worker(f"s{k}", serve, wait=False, **config))
        for proc in procs:
            stack.wait_registered(proc)
        submitter = Submitter(stack.client(), classes)
        for n in size.order():
            submitter.workers = n
            steps.append(_step(stack, submitter, n, size))
    return steps


def _bracket(steps: list[dict[str, Any]], i: int) -> list[float]:
    """Rates of the nearest one-worker steps before and after step ``i``."""
    before = [s["rate"] for s in steps[:i] if s["workers"] == 1][-1:]
    after = [s["rate"] for s in steps[i + 1 :] if s["workers"] == 1][:1]
    return before + after


def summarize(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per N: mean rate, and efficiency against the one-worker steps bracketing its runs
    (the one-worker row compares with all of them)."""
    out = []
    for n in sorted({s["workers"] for s in steps}):
        runs = [i for i, s in enumerate(steps) if s["workers"] == n]
        rates = [steps[i]["rate"] for i in runs]
        near = rates if n == 1 else [rate for i in runs for rate in _bracket(steps, i)]
        one = float(np.mean(near))
        rate = float(np.mean(rates))
        out.append(
            {
                "workers": n,
                "runs": len(runs),
                "tasks": sum(steps[i]["tasks"] for i in runs),
                "rate": rate,
                "span_rate": float(np.mean([steps[i]["span_rate"] for i in runs])),
                "one": one,
                "efficiency": rate / (n * one),
                "spread": (max(rates) - min(rates)) / rate,
                "run_ms": float(np.mean([steps[i]["run_ms"] for i in runs])),
                "gap_ms": float(np.median([steps[i]["gap_ms"] for i in runs])),
            }
        )
    return out


def _cells(r: dict[str, Any]) -> list[Any]:
    spread = f"{r['spread']:.1%}"
    return [
        r["workers"] * r["one"],
        r["efficiency"],
        r["span_rate"],
        spread,
        r["run_ms"],
        r["gap_ms"],
    ]


def run(size: str, outdir: Path) -> Report:
    cfg = SIZES[size]
    rows = summarize(measure(cfg))
    report = Report("scaling", size)
    report.tables.append(
        Table(
            f"Throughput on N workers, saturated queue of {cfg.task_s * 1000:.0f} ms tasks",
            "N | runs | tasks | tasks/s (saturated) | N x one worker (bracketing runs) | "
            "efficiency | tasks/s first start -> last end | spread between runs | mean run ms | "
            "median end->next start ms",
            [[*(r[k] for k in ("workers", "runs", "tasks", "rate")), *_cells(r)] for r in rows],
            "Saturated tasks/s: the sum over workers of each one's rate from its first task's "
            "start to its last task's start. First start -> last end also counts the staggered "
            "wake-up and the uneven tail of a short run (a worker doing one task more than "
            f"another), which shrink as runs get longer. Step order: "
            f"{', '.join(map(str, cfg.order()))}. Ceiling per worker without any overhead: "
            f"{1 / cfg.task_s:.1f} tasks/s.",
        )
    )
    for r in rows:
        goal = {4: 0.97, 8: 0.95}.get(r["workers"])
        if goal is not None:
            report.targets.append(
                judged(
                    f"throughput on {r['workers']} workers, equal tasks, saturated",
                    f"{r['workers']} x one worker = {r['workers'] * r['one']:.1f}/s",
                    r["efficiency"],
                    f">= {goal:.2f} N",
                    digits=3,
                )
            )
    report.charts.append(_chart(rows, outdir))
    report.write(outdir)
    return report


def _chart(steps: list[dict[str, Any]], outdir: Path) -> str:
    fig, (left, right) = figure(9.0, 3.4, ncols=2)
    ns = [s["workers"] for s in steps]
    left.plot(ns, [s["rate"] for s in steps], "o-", label="measured")
    left.plot(
        ns, [n * s["one"] for n, s in zip(ns, steps, strict=True)], "--", label="N x one worker"
    )
    axes(left, "Throughput", "workers", "tasks / s", legend=10)
    right.plot(ns, [s["efficiency"] for s in steps], "o-")
    right.axhline(0.95, color="grey", linestyle=":")
    right.set_ylim(0.8, 1.05)
    axes(right, "Efficiency X(N) / (N X(1))", "workers", "efficiency")
    return save(fig, outdir, "scaling.png")
