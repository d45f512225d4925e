"""Admission arithmetic against known drain rates."""

from __future__ import annotations

import pytest

from dispatcher.api.admission import (
    NO_WORKERS_RETRY_S,
    estimate_s,
    pressure,
    retry_after_s,
    retry_after_wait_s,
)
from dispatcher.contract.settings import ClassConfig

CFG = ClassConfig(max_queued=100, max_wait_s=60)


def test_estimate() -> None:
    assert estimate_s(ahead=0, run_s=2.0, workers=4) == 0.5
    assert estimate_s(ahead=9, run_s=2.0, workers=4) == 5.0
    assert estimate_s(ahead=3, run_s=2.0, workers=0) is None


@pytest.mark.parametrize(
    ("depth", "run_s", "workers", "expected"),
    [
        (0, 1.0, 2, "ok"),
        (49, 0.01, 2, "ok"),
        (50, 0.01, 2, "high"),  # half of max_queued
        (59, 1.0, 1, "high"),  # estimate 60 s: at max_wait_s but not over
        (60, 1.0, 1, "full"),  # estimate 61 s > 60 s
        (100, 0.01, 8, "full"),  # max_queued reached
        (0, 1.0, 0, "ok"),  # batch-like class queues without workers
    ],
)
def test_pressure(depth: int, run_s: float, workers: int, expected: str) -> None:
    assert pressure(depth, run_s, workers, CFG) == expected


def test_pressure_without_workers_when_class_requires_them() -> None:
    cfg = ClassConfig(reject_without_workers=True)
    assert pressure(0, 1.0, 0, cfg) == "full"


def test_retry_after_by_wait_limit() -> None:
    # 2 workers, 1 s per task: drains 2 tasks/s. A new task is accepted behind at most
    # floor(60 * 2 / 1) - 1 = 119 tasks; 129 queued -> 10 too many -> 5 s.
    cfg = ClassConfig(max_queued=1000, max_wait_s=60)
    assert retry_after_s(129, 1.0, 2, cfg) == 5


def test_retry_after_by_depth_limit() -> None:
    # max_queued 100 -> accepted behind at most 99; depth 100 with 4 tasks/s -> 1 s (never 0).
    assert retry_after_s(100, 0.25, 1, CFG) == 1
    assert retry_after_s(140, 0.25, 1, CFG) == 11  # 41 too many at 4/s -> 10.25 -> 11


def test_retry_after_without_workers() -> None:
    assert retry_after_s(5, 1.0, 0, CFG) == NO_WORKERS_RETRY_S


def test_retry_after_a_wait_refusal_comes_from_the_estimate_that_refused_it() -> None:
    cfg = ClassConfig(max_wait_s=10)
    assert retry_after_wait_s(12.0, cfg) == 2  # 2 s too long: back under it in 2 s
    assert retry_after_wait_s(10.001, cfg) == 1
    assert retry_after_wait_s(10**6, cfg) == 3600
    # Fair share: a small tenant's estimate counts 3 tasks ahead, not the class's 300
    # (which the depth arithmetic would use: 300 at 0.5/s is 10 minutes).
    assert retry_after_wait_s((3 / 2 + 1 / 2) * 4 + 4, cfg) == 2
    assert retry_after_s(300, 4.0, 2, cfg) > 500
