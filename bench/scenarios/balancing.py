"""Scenario 2, balancing: one heavy-tailed trace through pull and push dispatch.

The seeded trace of :mod:`bench.trace` (log-normal sizes, mean 200 ms; Poisson
arrivals at 70 % and 90 % load of 4 workers) is replayed on time, in one run, through
three real systems side by side, each with its own ``redis-server`` and four real
``gpulane worker`` processes running the built-in ``sleep`` task:

- ``gpulane (pull)``: every task joins one shared class queue; a free worker pulls.
- ``round-robin push``: each worker serves its own queue (a class of its own); the
  router assigns task i to worker i mod 4 when it arrives.
- ``least-connections push``: same queues; the router assigns each task, when it
  arrives, to the worker with the fewest outstanding tasks (queued + running, read
  from Redis at that instant), ties broken round-robin.

Worker code, Redis, submit path (``submit.lua``, as the API calls it) and per-task
overhead are identical; only the dispatch policy differs. The ideal zero-overhead
central queue (M/G/4 FCFS) and zero-overhead models of both routers are computed on
the same trace as references. Latency is end to end: created -> ended (Redis clock).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import hetero
from bench import trace as tr
from bench.harness import Stack
from bench.replay import System, replay_systems, started
from bench.report import Report, Table, axes, figure, grouped_bars, info, judged, latency_cdf, save

SYSTEMS = ("pull", "rr", "lc")
LABELS = {
    "ideal": "ideal central queue (model)",
    "pull": "gpulane (pull)",
    "rr": "round-robin push",
    "lc": "least-connections push",
    "rr_model": "round-robin (model)",
    "lc_model": "least-connections (model)",
}
LOADS = (0.7, 0.9)


@dataclass(frozen=True)
class Size:
    tasks: int
    workers: int = 4
    mean_s: float = 0.2


SIZES = {
    "smoke": Size(tasks=30, workers=2, mean_s=0.05),
    "quick": Size(tasks=160),
    "full": Size(tasks=2000),
}


def system(kind: str, stack: Stack, workers: int) -> System:
    """``kind``'s system on ``stack``: workers ``{kind}0``... running the built-in sleep."""
    return System(kind, stack, [f"{kind}{k}" for k in range(workers)], "sleep")


# -- measuring ----------------------------------------------------------------------


def replay_all(systems: list[System], trace: tr.Trace) -> dict[str, list[tr.Task]]:
    """Replay ``trace`` through every system at once; their tasks once all ended."""
    return replay_systems(systems, trace, 60 + 4 * sum(trace.services) / trace.workers)


def measure(size: Size) -> dict[float, dict[str, Any]]:
    results: dict[float, dict[str, Any]] = {}
    with started(SYSTEMS, lambda kind, stack: system(kind, stack, size.workers)) as systems:
        for load in LOADS:
            trace = tr.make_trace(size.tasks, size.workers, load, size.mean_s)
            runs: dict[str, Any] = replay_all(systems, trace)
            runs["ideal"] = hetero.ideal(trace)
            runs["rr_model"] = hetero.round_robin(trace)
            runs["lc_model"] = hetero.least_connections(trace)
            results[load] = {"trace": trace, "runs": runs}
    return results


# -- report -------------------------------------------------------------------------
ORDER = ("ideal", "pull", "rr", "lc", "rr_model", "lc_model")


def run(size: str, outdir: Path) -> Report:
    cfg = SIZES[size]
    results = measure(cfg)
    report = Report("balancing", size)
    stats = {
        load: {k: tr.metrics(v, cfg.workers) for k, v in r["runs"].items()}
        for load, r in results.items()
    }
    for load, r in results.items():
        report.tables.append(_load_table(load, r, stats[load], cfg))
    _targets(report, stats, cfg.workers)
    report.charts.append(_chart(results, stats, outdir))
    report.notes.append(
        "Idle share: worker time spent idle while a task waited in a queue that worker "
        "could not or did not serve (another worker's queue; for pull, the shared queue), "
        "over workers x makespan, on a 1 ms grid."
    )
    report.write(outdir)
    return report


def _load_table(load: float, r: dict[str, Any], stats: dict[str, tr.Metrics], cfg: Size) -> Table:
    ideal = stats["ideal"]
    rows = []
    for key in ORDER:
        m = stats[key]
        rows.append(
            [LABELS[key], m.p50, m.p95, m.p99, m.makespan, m.idle_share * 100, m.p99 / ideal.p99]
        )
    trace: tr.Trace = r["trace"]
    run_s = [t.ended - t.started for t in r["runs"]["pull"]]
    mean_ms = sum(trace.services) / len(trace.services) * 1000
    note = (
        f"{len(trace.services)} tasks, {cfg.workers} workers, mean size {mean_ms:.0f} ms, "
        f"max {max(trace.services):.2f} s; "
        f"gpulane's measured mean run time {sum(run_s) / len(run_s) * 1000:.1f} ms "
        "(size plus per-task overhead)."
    )
    return Table(
        f"End-to-end latency at {load:.0%} load (seconds)",
        "system | p50 | p95 | p99 | makespan | idle while work waited % | p99 / ideal",
        rows,
        note,
    )


def _targets(report: Report, stats: dict[float, dict[str, tr.Metrics]], workers: int) -> None:
    s = stats[max(stats)]
    pull, ideal, rr, lc = s["pull"].p99, s["ideal"].p99, s["rr"].p99, s["lc"].p99
    report.targets += [
        judged(
            f"p99 latency, 90% load, heavy tail, {workers} workers",
            f"ideal central queue: {ideal:.2f} s",
            pull / ideal,
            "<= 1.10x ideal",
            f"{pull:.2f} s = {pull / ideal:.2f}x",
        ),
        info("p99 vs round-robin push, 90% load", f"round-robin: {rr:.2f} s", f"{pull / rr:.2f}x",
             "~0.3x"),
        info("p99 vs least-connections push, 90% load", f"least-connections: {lc:.2f} s",
             f"{pull / lc:.2f}x"),
    ]  # fmt: skip


def _chart(
    results: dict[float, Any], stats: dict[float, dict[str, tr.Metrics]], outdir: Path
) -> str:
    fig, (left, right) = figure(10.0, 3.6, ncols=2)
    runs = results[max(results)]["runs"]
    cdf_keys = ("ideal", "pull", "rr", "lc")
    latency_cdf(left, {LABELS[k]: [t.ended - t.created for t in runs[k]] for k in cdf_keys})
    left.set_title(f"Latency CDF at {max(results):.0%} load")
    left.legend(fontsize=8)
    keys_ = ("ideal", "pull", "lc", "rr")
    bars = {f"{load:.0%} load": [s[k].p99 for k in keys_] for load, s in sorted(stats.items())}
    grouped_bars(right, bars, ["ideal", "gpulane\n(pull)", "least-\nconn.", "round-\nrobin"])
    axes(right, "p99 end-to-end latency", y="p99 latency (s)", legend=8)
    return save(fig, outdir, "balancing.png")
