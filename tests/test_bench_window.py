"""The saturation rate every system in ``bench overhead`` is timed by (Celery, plain
RQ and gpulane alike): between handler starts, over the span all workers ran."""

from __future__ import annotations

import math

from bench.scenarios.overhead import window_rate


def test_one_worker_counts_first_to_last_start() -> None:
    stamps = [{"t": 10.0 + k * 0.5, "w": 1} for k in range(5)]  # 4 gaps over 2 s
    got = window_rate(stamps)
    assert got == {"rate": 2.0, "workers_seen": 1, "window_tasks": 5}


def test_span_starts_when_the_last_worker_began_and_ends_with_the_first_to_stop() -> None:
    early = [{"t": float(t), "w": "a"} for t in range(0, 11)]  # 0..10 s
    late = [{"t": float(t), "w": "b"} for t in range(4, 9)]  # booted at 4, last start 8
    got = window_rate(early + late)
    # Inside [4, 8]: a's 5 starts and b's 5 starts, 9 intervals over 4 s.
    assert got["workers_seen"] == 2
    assert got["window_tasks"] == 10
    assert got["rate"] == 9 / 4


def test_workers_that_never_overlapped_have_no_rate() -> None:
    got = window_rate([{"t": float(t), "w": 1 if t < 3 else 2} for t in (1, 2, 3, 4)])
    assert math.isnan(got["rate"])


def test_a_worker_that_began_one_task_bounds_no_span() -> None:
    early = [{"t": float(t), "w": "a"} for t in range(0, 5)]
    got = window_rate([*early, {"t": 4.5, "w": "late"}])
    assert got == {"rate": 1.0, "workers_seen": 1, "window_tasks": 5}
