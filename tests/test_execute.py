"""The runner's interrupts, in process: a request stops only the run it names, and a
cancel that arrives before its run (or its batch) starts is not lost."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from pydantic import BaseModel

from dispatcher.contract.jobs import encode_call
from worker.batching import BatchRunner
from worker.claims import Claimed
from worker.execute import Interrupts, Outcome, Runner
from worker.registry import Batch, Registry, TaskCanceled


class Args(BaseModel):
    seconds: float = 0.0


@pytest.fixture
def runner() -> Iterator[tuple[Runner, list[str]]]:
    ran: list[str] = []
    registry = Registry()

    @registry.task("nap")
    def nap(args: Args, ctx: Any) -> str:
        ran.append(ctx.task_id)
        time.sleep(args.seconds)
        return "woke"

    yield Runner(registry, Interrupts(), lambda *_: None, {}, "w", 1 << 20), ran


def _claimed(task_id: str, seconds: float = 0.0) -> Claimed:
    data = encode_call("nap", {"seconds": seconds})
    return Claimed(task_id, "batch", data, 1, 30.0, None, 0, None)


def test_a_request_for_another_run_is_ignored() -> None:
    interrupts = Interrupts()
    finished, other = object(), object()
    with interrupts.armed(30, finished):
        interrupts.request(TaskCanceled, other)  # meant for a run that already ended
        time.sleep(0.05)  # the signal is delivered here, and must not raise
    with pytest.raises(TaskCanceled), interrupts.armed(30, finished):
        interrupts.request(TaskCanceled, finished)
        time.sleep(5)


def _run(runner: Runner, claimed: Claimed) -> Outcome:
    """A single task through the one run path: a batch of one."""
    (item,) = BatchRunner(runner).run([claimed])
    assert item.outcome is not None
    return item.outcome


def test_cancel_before_the_run_starts_is_kept(runner: tuple[Runner, list[str]]) -> None:
    run, ran = runner
    run.cancel("t1")  # the heartbeat saw the cancel between claim and start
    assert _run(run, _claimed("t1")).status == "canceled" and ran == []
    outcome = _run(run, _claimed("t2"))  # other tasks are not affected
    assert outcome.status == "finished" and ran == ["t2"]
    assert outcome.result_json == '"woke"'


def test_cancel_of_the_running_task_stops_it(runner: tuple[Runner, list[str]]) -> None:
    run, _ = runner
    threading.Timer(0.2, run.cancel, args=("t3",)).start()
    assert _run(run, _claimed("t3", seconds=30)).status == "canceled"


def test_a_single_task_times_out_and_refuses_what_it_cannot_run(
    runner: tuple[Runner, list[str]],
) -> None:
    run, _ = runner
    slow = Claimed("t4", "batch", encode_call("nap", {"seconds": 30}), 1, 0.2, None, 0, None)
    timed_out = _run(run, slow)
    assert timed_out.status == "failed" and timed_out.error == {
        "code": "timeout",
        "message": "Ran past its timeout of 0.2 s.",
    }
    unknown = Claimed("t5", "batch", encode_call("nope", {}), 1, 30.0, None, 0, None)
    assert (_run(run, unknown).error or {})["code"] == "unknown_task_type"
    chunk = encode_call("nap", {}, items=[{}, {}])  # a chunk of a type that is not batched
    refused = _run(run, Claimed("t6", "batch", chunk, 1, 30.0, None, 0, None, "nap", 2))
    assert (refused.error or {})["code"] == "invalid_args"
    bad = _run(run, Claimed("t7", "batch", b"\x80", 1, 30.0, None, 0, None))  # not a call
    assert (bad.error or {})["code"] == "refused"


def test_cancel_before_a_batch_starts_keeps_the_item_out_of_the_call() -> None:
    """A cancel that reaches the worker between the batch's claim and its first call
    (while it waits to fill) ends the item ``canceled`` without running it."""
    calls: list[list[str]] = []
    registry = Registry()

    @registry.task("naps", batch=Batch(max_size=4, max_wait_ms=0))
    def naps(batch: list[Args], ctxs: list[Any]) -> list[str]:
        calls.append([ctx.task_id for ctx in ctxs])
        return ["woke"] * len(batch)

    runner = Runner(registry, Interrupts(), lambda *_: None, {}, "w", 1 << 20)
    claims = [
        Claimed(task_id, "batch", encode_call("naps", {}), 1, 30.0, None, 0, None)
        for task_id in ("t0", "t1", "t2")
    ]
    runner.cancel("t1")
    items = BatchRunner(runner).run(claims)
    assert calls == [["t0", "t2"]]
    assert [i.outcome.status if i.outcome else None for i in items] == [
        "finished",
        "canceled",
        "finished",
    ]


def test_a_chunks_invalid_items_fail_alone_and_the_valid_ones_run() -> None:
    """A chunk's args are checked in one call; where that fails, item by item: each
    invalid one fails alone with its message, the others run (a worker whose schema is
    newer than the catalog that admitted them)."""
    registry = Registry()

    @registry.task("double", batch=Batch(max_size=8, max_wait_ms=0))
    def double(batch: list[Args], ctxs: list[Any]) -> list[float]:
        return [args.seconds * 2 for args in batch]

    run = Runner(registry, Interrupts(), lambda *_: None, {}, "w", 1 << 20)
    items = [{"seconds": 1}, {"seconds": "x"}, {"seconds": 3}, {"other": 1, "seconds": []}]
    chunk = Claimed("c1", "batch", encode_call("double", {}, items=items), 1, 30, None, 0, None)
    result = json.loads(_run(run, replace(chunk, task_type="double", items=4)).result_json)
    assert result["results"][0] == 2 and result["results"][2] == 6
    assert set(result["errors"]) == {"1", "3"}
    assert all(e["code"] == "invalid_args" for e in result["errors"].values())
    assert "seconds" in result["errors"]["1"]["message"]
    whole = encode_call("double", {}, items=[{"seconds": 1}, {"seconds": 2}])
    valid = _run(run, Claimed("c2", "batch", whole, 1, 30, None, 0, None, "double", 2))
    assert json.loads(valid.result_json)["results"] == [2, 4]
