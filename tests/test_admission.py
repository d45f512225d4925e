"""Admission arithmetic against known drain rates: the read side's (GET /queues), and
what submit.lua answers a submit with (pressure, Retry-After), on the real Redis."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from dispatcher.api.admission import estimate_s, pressure
from dispatcher.api.store import Record, Submission, submit_options
from dispatcher.contract import keys
from dispatcher.contract.jobs import encode_call
from dispatcher.contract.scripts import SyncScripts
from dispatcher.contract.settings import ClassConfig, Settings

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


def _answer(
    r: redis.Redis,
    cfg: ClassConfig,
    *,
    run_s: float,
    workers: int,
    queued: int = 0,
    items: int = 1,
    serving: int | None = None,
) -> tuple[str, str, int]:
    """submit.lua's verdict and what it decided with it for a request of ``items`` items
    behind ``queued`` queued tasks (``serving`` workers, ``workers`` of them fitting):
    accepted, the pressure and 0; refused, the limit reached and the Retry-After."""
    settings = Settings(redis_url="redis://unused", classes={"batch": cfg, "interactive": cfg})
    if queued:
        r.rpush(keys.queue("batch"), *[f"filler-{i}" for i in range(queued)])
    sub = Submission("echo", "batch", {}, timeout_s=60, tenant="t")
    records = [Record("echo", encode_call("echo", {}), 60, items=items)]
    opts = submit_options(sub, cfg, workers, run_s, settings, serving, records)
    reply: list[Any] = SyncScripts(r).run("submit", opts, records[0].data, "")
    verdict = reply[0].decode()
    if verdict == "accepted":
        return verdict, reply[5].decode(), 0
    return verdict, reply[4].decode(), int(reply[5])


def test_retry_after_by_wait_limit(r: redis.Redis) -> None:
    # 2 workers, 1 s per task: 129 ahead wait (129 / 2 + 1 / 2) s = 65 s, 5 s over 60.
    cfg = ClassConfig(max_queued=1000, max_wait_s=60)
    assert _answer(r, cfg, run_s=1.0, workers=2, queued=129) == ("queue_full", "wait", 5)


def test_retry_after_by_depth_limit(r: redis.Redis) -> None:
    # max_queued 100: at 100 queued one more is 1 too many, gone in 0.25 s: 1 s (never 0).
    assert _answer(r, CFG, run_s=0.25, workers=1, queued=100) == ("queue_full", "depth", 1)


def test_retry_after_by_depth_counts_the_whole_request(r: redis.Redis) -> None:
    # 140 queued and 1 more is 41 too many at 4/s: 10.25 s, so 11.
    assert _answer(r, CFG, run_s=0.25, workers=1, queued=140)[2] == 11


def test_retry_after_a_request_of_many_items_waits_for_room_for_all(r: redis.Redis) -> None:
    # 90 queued, a chunk of 30 items: 20 too many at 4/s is 5 s.
    assert _answer(r, CFG, run_s=0.25, workers=1, queued=90, items=30)[2] == 5


def test_retry_after_without_a_fitting_worker(r: redis.Redis) -> None:
    # Workers serve the class, none fits: about one lease, whatever the queue.
    assert _answer(r, CFG, run_s=1.0, workers=0, serving=2) == ("no_workers", "", 5)


def test_retry_after_a_wait_refusal_comes_from_the_estimate_that_refused_it(
    r: redis.Redis,
) -> None:
    cfg = ClassConfig(max_wait_s=10)
    # 11 ahead at 1 s on 1 worker: the estimate is 12 s, 2 s too long.
    assert _answer(r, cfg, run_s=1.0, workers=1, queued=11) == ("queue_full", "wait", 2)
    # At most an hour, however deep.
    assert _answer(r, ClassConfig(max_queued=10**6, max_wait_s=10), run_s=100.0, workers=1,
                   queued=500)[2] == 3600  # fmt: skip


@pytest.mark.parametrize(
    ("queued", "run_s", "workers", "expected"),
    [
        (0, 1.0, 2, "ok"),
        (48, 0.01, 2, "ok"),  # 49 of 100 after it
        (49, 0.01, 2, "high"),  # half of max_queued after it
        (58, 1.0, 1, "high"),  # the next one's estimate is 60 s: at max_wait_s, not over
        (59, 1.0, 1, "full"),  # the next one's would be 61 s
        (99, 0.01, 8, "full"),  # max_queued reached: the next is refused
    ],
)
def test_the_pressure_of_an_accepted_submit_is_what_the_next_one_meets(
    r: redis.Redis, queued: int, run_s: float, workers: int, expected: str
) -> None:
    assert _answer(r, CFG, run_s=run_s, workers=workers, queued=queued) == ("accepted", expected, 0)


def test_an_unmeasured_run_time_never_raises_the_pressure(r: redis.Redis) -> None:
    # A fresh pool's guess of the run time (measured false) never refuses, nor warns.
    settings = Settings(redis_url="redis://unused")
    cfg = ClassConfig(max_wait_s=1)
    r.rpush(keys.queue("batch"), *[f"filler-{i}" for i in range(10)])
    sub = Submission("echo", "batch", {}, timeout_s=60, tenant="t")
    records = [Record("echo", encode_call("echo", {}), 60)]
    opts = submit_options(sub, cfg, 1, 30.0, settings, None, records, measured=False)
    reply = SyncScripts(r).run("submit", opts, records[0].data, "")
    assert reply[0] == b"accepted" and reply[5] == b"ok"
