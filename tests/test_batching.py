"""Dynamic batching with a fast batched test type (``test.batch_echo``: max size 4,
20 ms wait), real workers, real Redis, real HTTP. Each handler call appends one line
with its batch's values to a file: the batches as the worker really formed them.

Every test runs twice: reports inline with the next claim, and in the background
while the next batch runs (``report_overlap``, a GPU worker's default)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import WorkerFactory, make_settings, submit, wait_status

from dispatcher.contract.settings import ClassConfig, ReportOverlap, Settings
from testkit import wait_for

ECHO = "test.batch_echo"
FINAL = {"succeeded", "failed", "canceled"}


@pytest.fixture
def settings(redis_url: str) -> Settings:
    # Interactive tasks may queue before any worker is up (the tests start it after).
    return make_settings(
        redis_url,
        classes={"interactive": ClassConfig(max_wait_s=30), "batch": ClassConfig()},
    )


@pytest.fixture(params=[ReportOverlap.NEVER, ReportOverlap.ALWAYS], ids=lambda m: f"report-{m}")
def start_worker(start_worker: WorkerFactory, request: pytest.FixtureRequest) -> WorkerFactory:
    def start(*args: Any, **kwargs: Any) -> Any:
        proc = start_worker(*args, report_overlap=request.param.value, **kwargs)
        if request.param == ReportOverlap.ALWAYS:  # the mode is on, not just asked for
            line = "reports each batch while the next one runs"
            wait_for(lambda: line in proc.output(), 10, what="the worker's overlap log line")
        return proc

    return start


def _lines(path: Path) -> list[list[str]]:
    return [line.split() for line in path.read_text().splitlines()]


def _echo(http: httpx.Client, value: int, path: Path, cls: str = "batch", **args: Any) -> str:
    task = submit(http, ECHO, {"value": value, "path": str(path), **args}, cls=cls)
    return str(task["id"])


def _finals(http: httpx.Client, ids: list[str]) -> list[dict[str, Any]]:
    return [wait_status(http, task_id, FINAL, 30) for task_id in ids]


def test_queued_tasks_run_in_batches_up_to_max_size(
    known_types: None, http: httpx.Client, start_worker: WorkerFactory, tmp_path: Path
) -> None:
    log = tmp_path / "calls"
    ids = [_echo(http, i, log) for i in range(10)]
    start_worker()
    records = _finals(http, ids)
    assert [r["result"] for r in records] == [{"value": i} for i in range(10)]
    calls = _lines(log)
    assert sorted(int(v) for call in calls for v in call) == list(range(10))  # each once
    assert max(len(call) for call in calls) > 1
    assert all(len(call) <= 4 for call in calls)
    assert calls[0] == ["0", "1", "2", "3"]  # the queue's head, in order

    def batch_metric() -> str | None:
        text = http.get("/metrics").text
        line = f'gpulane_batch_size_count{{type="{ECHO}"}} {float(len(calls))}'
        return text if line in text else None

    wait_for(batch_metric, 10, what="gpulane_batch_size in /metrics")


def test_one_bad_item_fails_alone(
    known_types: None, http: httpx.Client, start_worker: WorkerFactory, tmp_path: Path
) -> None:
    log = tmp_path / "calls"
    ids = [_echo(http, i, log, fail=i == 2) for i in range(4)]
    worker = start_worker(log_level="INFO")  # whatever the environment says
    records = _finals(http, ids)
    assert [r["status"] for r in records] == ["succeeded", "succeeded", "failed", "succeeded"]
    assert records[2]["error"]["code"] == "bad_item"
    assert _lines(log) == [["0", "1", "2", "3"]]  # one call
    # The worker's INFO lines: the batch's two, naming every task, and the failure's.
    ended = "batch of 4 records ended: 1 failed, 3 succeeded"
    wait_for(lambda: ended in worker.output(), 10, what="the batch's end line")
    out = worker.output()
    assert f"tasks={','.join(ids)}" in out.split(ended)[1].splitlines()[0]
    assert f"task failed  [worker={worker.name} task={ids[2]}" in out
    assert "task succeeded" not in out and "task started" not in out  # DEBUG


def test_sigkill_mid_batch_puts_every_item_back(
    known_types: None, http: httpx.Client, start_worker: WorkerFactory, tmp_path: Path
) -> None:
    log = tmp_path / "calls"
    ids = [_echo(http, i, log, seconds=1.5) for i in range(4)]
    a = start_worker("batch-kill-a")

    def whole_batch() -> dict[str, Any] | None:
        workers = http.get("/workers").json()["workers"]
        return next((w for w in workers if len(w["current_batch"]) == 4), None)

    entry = wait_for(whole_batch, 15, what="the worker to run a batch of 4")
    assert entry["current_batch"] == ids and entry["current_task"] == ids[0]
    a.kill()
    start_worker("batch-kill-b")
    records = _finals(http, ids)
    assert all(r["status"] == "succeeded" for r in records), records
    assert all(r["attempts"] == 2 and r["worker"] == "batch-kill-b" for r in records)


def test_cancel_one_item_of_a_running_batch(
    known_types: None, http: httpx.Client, start_worker: WorkerFactory, tmp_path: Path
) -> None:
    log = tmp_path / "calls"
    ids = [_echo(http, i, log, seconds=1.0) for i in range(4)]
    start_worker()
    for task_id in ids:
        wait_status(http, task_id, {"running"})
    assert http.delete(f"/tasks/{ids[1]}").status_code == 202
    records = _finals(http, ids)
    assert [r["status"] for r in records] == ["succeeded", "canceled", "succeeded", "succeeded"]
    calls = _lines(log)
    assert calls[0] == ["0", "1", "2", "3"]
    assert calls[-1] == ["0", "2", "3"]  # the others ran again, without it


def test_timeout_fails_only_the_items_past_their_own(
    known_types: None, http: httpx.Client, start_worker: WorkerFactory, tmp_path: Path
) -> None:
    log = tmp_path / "calls"
    short = submit(http, ECHO, {"value": 0, "path": str(log), "seconds": 1.0}, timeout_s=0.3)
    ids = [short["id"], _echo(http, 1, log, seconds=1.0)]
    start_worker()
    records = _finals(http, ids)
    assert [r["status"] for r in records] == ["failed", "succeeded"]
    assert records[0]["error"]["code"] == "timeout"
    assert _lines(log) == [["0", "1"], ["1"]]  # the other item ran again, alone


def test_cancel_of_an_item_that_already_timed_out_leaves_the_next_call_alone(
    known_types: None, http: httpx.Client, start_worker: WorkerFactory, tmp_path: Path
) -> None:
    """An item's outcome is reported when the whole batch ends, so a client can still
    cancel it after it timed out: that cancel is for no item of the call now running."""
    log = tmp_path / "calls"
    short = submit(http, ECHO, {"value": 0, "path": str(log), "seconds": 1.5}, timeout_s=0.3)
    ids = [short["id"], _echo(http, 1, log, seconds=1.5)]
    start_worker()
    wait_for(lambda: (log.exists() and len(_lines(log)) == 2) or None, 15, what="the second call")
    assert http.delete(f"/tasks/{ids[0]}").status_code == 202  # still running to the API
    records = _finals(http, ids)
    assert [r["status"] for r in records] == ["failed", "succeeded"]
    assert records[0]["error"]["code"] == "timeout"
    assert _lines(log) == [["0", "1"], ["1"]]  # the second call ran to its end, once


def test_interactive_batches_before_batch_class_items(
    known_types: None, http: httpx.Client, start_worker: WorkerFactory, tmp_path: Path
) -> None:
    log = tmp_path / "calls"
    ids = [_echo(http, i, log) for i in range(3)]
    ids += [_echo(http, i, log, cls="interactive") for i in (10, 11)]
    start_worker()
    _finals(http, ids)
    assert _lines(log) == [["10", "11"], ["0", "1", "2"]]  # classes never share a batch


def test_other_types_keep_their_order(
    known_types: None, http: httpx.Client, start_worker: WorkerFactory, tmp_path: Path
) -> None:
    log = tmp_path / "calls"
    ids = [_echo(http, 0, log)]
    ids.append(submit(http, "test.record", {"path": str(log), "tag": "A"})["id"])
    ids += [_echo(http, 1, log), _echo(http, 2, log)]
    ids.append(submit(http, "test.record", {"path": str(log), "tag": "B"})["id"])
    ids.append(_echo(http, 3, log))
    start_worker()
    _finals(http, ids)
    # A batch takes only the run of its type at the head of the queue.
    assert _lines(log) == [["0"], ["A"], ["1", "2"], ["B"], ["3"]]


def test_size_one_override_turns_batching_off(
    known_types: None, http: httpx.Client, start_worker: WorkerFactory, tmp_path: Path
) -> None:
    log = tmp_path / "calls"
    ids = [_echo(http, i, log) for i in range(5)]
    start_worker(env={"GPULANE_TYPES": json.dumps({ECHO: {"batch_max_size": 1}})})
    assert all(r["status"] == "succeeded" for r in _finals(http, ids))
    assert _lines(log) == [[str(i)] for i in range(5)]
