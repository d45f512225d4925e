"""Fencing: a worker's reports (finish, release, progress, and the heartbeat's check of
its running task) count only while it runs the task's current attempt. A worker that
lost its lease (a partition, a stall) and whose task was given back and started again
is refused, the record is left alone, and the refusal is counted.

Script tests drive the Lua on the real Redis; the last test stalls a real worker
process past its lease (SIGSTOP) and lets it wake up after another worker took over.
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import httpx
import pytest
import redis
from conftest import WorkerFactory, wait_status
from support.lua import CLASSES, SETTINGS, claim_tasks, finish, register, submit

from dispatcher.api.exporter import parse, pool_families, render
from dispatcher.api.pool import Snapshot
from dispatcher.contract import keys
from dispatcher.contract.reap import lease_options, reap_options
from dispatcher.contract.scripts import SyncScripts, options
from testkit import wait_for


def _claim(s: SyncScripts, worker: str) -> int:
    """Claim the next task; its attempt number (the fencing token)."""
    (task,) = claim_tasks(s, worker)  # one task: not a batched type
    return int(task[3])


def _finish(s: SyncScripts, worker: str, task_id: str, attempt: int) -> bytes:
    return finish(s, worker, task_id, {"by": worker, "attempt": attempt}, attempt)


def _progress(s: SyncScripts, worker: str, task_id: str, attempt: int, message: str) -> int:
    opts = options(id=task_id, worker=worker, attempt=attempt)
    return int(s.run("progress", opts, json.dumps({"fraction": 0.5, "message": message})))


def _release(s: SyncScripts, worker: str, task_id: str, attempt: int) -> bytes:
    opts = options(**lease_options(SETTINGS), id=task_id, worker=worker, attempt=attempt,
                   at_head=True, **{"class": "batch"})  # fmt: skip
    return bytes(s.run("release", opts))


def _heartbeat_holds(s: SyncScripts, worker: str, task_id: str, attempt: int) -> bool:
    opts = options(worker=worker, ttl_ms=1000, tau_s=20, info={}, counters={}, floats={},
                   runs={}, task={"id": task_id, "attempt": attempt},
                   rq={"fields": {}, "queues": CLASSES, "execution": None})  # fmt: skip
    return bool(s.run("heartbeat", opts)[2])


def _lose_lease(s: SyncScripts, r: redis.Redis, worker: str) -> None:
    """The worker stalls past its lease; a reaper pass gives its task back."""
    r.zadd(keys.WORKERS, {worker: 0})
    s.run("reap", reap_options(SETTINGS))
    assert r.zscore(keys.WORKERS, worker) is None


def _fenced(r: redis.Redis) -> dict[tuple[str, ...], float]:
    return parse(r.hgetall(keys.METRICS)).counters["fenced"]


@pytest.fixture
def s(r: redis.Redis) -> SyncScripts:
    return SyncScripts(r)


def test_stale_finish_after_a_reclaim_by_another_worker_is_fenced(
    r: redis.Redis, s: SyncScripts
) -> None:
    task_id = submit(s)
    register(s, "old")
    assert _claim(s, "old") == 1
    _lose_lease(s, r, "old")
    register(s, "new")
    assert _claim(s, "new") == 2
    before = r.hgetall(keys.job(task_id))
    assert _finish(s, "old", task_id, 1) == b"fenced"
    assert r.hgetall(keys.job(task_id)) == before  # record unchanged
    assert r.lrange(keys.inflight("new", "batch"), 0, -1) == [task_id.encode()]
    assert _fenced(r) == {("finish",): 1.0}
    assert _finish(s, "new", task_id, 2) == b"ok"
    assert json.loads(r.hget(keys.job(task_id), "result")) == {"by": "new", "attempt": 2}


def test_stale_finish_after_a_reclaim_under_the_same_name_is_fenced(
    r: redis.Redis, s: SyncScripts
) -> None:
    """A new process took the name of the stalled one and claimed the task again: the
    worker name matches, the attempt does not. The stale report must neither write the
    record nor take the task out of the new run's in-flight list."""
    task_id = submit(s)
    register(s, "w")
    assert _claim(s, "w") == 1
    _lose_lease(s, r, "w")
    register(s, "w")  # the name is free again: a fresh process takes it
    assert _claim(s, "w") == 2
    assert _finish(s, "w", task_id, 1) == b"fenced"
    assert r.hget(keys.job(task_id), "status") == b"started"
    assert r.lrange(keys.inflight("w", "batch"), 0, -1) == [task_id.encode()]
    assert _release(s, "w", task_id, 1) == b"fenced"
    assert r.lrange(keys.inflight("w", "batch"), 0, -1) == [task_id.encode()]
    assert r.llen(keys.queue("batch")) == 0
    assert _fenced(r) == {("finish",): 1.0, ("release",): 1.0}
    assert _finish(s, "w", task_id, 2) == b"ok"


def test_finish_of_a_given_back_task_nobody_restarted_is_kept(
    r: redis.Redis, s: SyncScripts
) -> None:
    """Given back but not started again: the stale run is still the latest attempt,
    so its result is kept and the task leaves the queue (no one runs it twice)."""
    task_id = submit(s)
    register(s, "w")
    _claim(s, "w")
    _lose_lease(s, r, "w")
    assert r.lrange(keys.queue("batch"), 0, -1) == [task_id.encode()]
    assert _finish(s, "w", task_id, 1) == b"ok"
    assert r.llen(keys.queue("batch")) == 0
    assert _fenced(r) == {}


def test_progress_only_from_the_current_run(r: redis.Redis, s: SyncScripts) -> None:
    task_id = submit(s)
    register(s, "old")
    _claim(s, "old")
    assert _progress(s, "old", task_id, 1, "first") == 1
    assert json.loads(r.hget(keys.job(task_id), "progress"))["message"] == "first"
    _lose_lease(s, r, "old")
    assert _progress(s, "old", task_id, 1, "stale, queued") == 0  # requeue cleared it
    assert r.hget(keys.job(task_id), "progress") == b""
    register(s, "new")
    _claim(s, "new")
    assert _progress(s, "new", task_id, 2, "current") == 1
    assert _progress(s, "old", task_id, 1, "stale, running elsewhere") == 0
    assert json.loads(r.hget(keys.job(task_id), "progress"))["message"] == "current"
    assert _fenced(r) == {("progress",): 2.0}


def test_progress_of_an_expired_record_does_not_recreate_it(r: redis.Redis, s: SyncScripts) -> None:
    assert _progress(s, "w", "no-such-task", 1, "late") == 0
    assert not r.exists(keys.job("no-such-task"))


def test_heartbeat_tells_a_worker_whether_it_still_holds_its_run(
    r: redis.Redis, s: SyncScripts
) -> None:
    task_id = submit(s)
    register(s, "old")
    _claim(s, "old")
    assert _heartbeat_holds(s, "old", task_id, 1)
    _lose_lease(s, r, "old")
    assert not _heartbeat_holds(s, "old", task_id, 1)  # given back: stop the run
    register(s, "new")
    _claim(s, "new")
    assert not _heartbeat_holds(s, "old", task_id, 1)
    assert _heartbeat_holds(s, "new", task_id, 2)


def test_fenced_reports_are_exported(r: redis.Redis, s: SyncScripts) -> None:
    task_id = submit(s)
    register(s, "old")
    _claim(s, "old")
    _lose_lease(s, r, "old")
    register(s, "new")
    _claim(s, "new")
    _finish(s, "old", task_id, 1)
    snap = Snapshot(now_ms=0, classes={})
    text = render(pool_families(parse(r.hgetall(keys.METRICS)), snap))[0].decode()
    assert 'gpulane_reports_fenced_total{report="finish"} 1.0' in text


@pytest.mark.slow
def test_stalled_worker_stops_its_stale_run_and_rejoins(
    r: redis.Redis, http: httpx.Client, start_worker: WorkerFactory
) -> None:
    """SIGSTOP stands in for a partition: the worker misses its lease, another worker
    runs the task again; on SIGCONT the stale worker learns from its heartbeat that the
    run is not its own any more, stops it without reporting, and serves again."""
    stale = start_worker("stale")
    task_id = http.post("/tasks", json={"type": "sleep", "args": {"seconds": 6}}).json()["id"]
    wait_for(lambda: r.hget(keys.job(task_id), "worker_name") == b"stale", 10, what="start")
    os.kill(stale.pid, signal.SIGSTOP)
    try:
        other = start_worker("other")
        wait_for(lambda: r.hget(keys.job(task_id), "worker_name") == b"other", 10, what="rerun")
    finally:
        os.kill(stale.pid, signal.SIGCONT)
    wait_for(lambda: "lease lost" in stale.output(), 10, what="the stale run to stop")
    wait_for(lambda: "task abandoned" in stale.output(), 10, what="the stale run to end")
    record: dict[str, Any] = http.get(f"/tasks/{task_id}").json()
    assert (record["worker"], record["attempts"]) == ("other", 2)  # the stale run reported nothing
    wait_for(
        lambda: (
            r.hget(keys.worker("stale"), "state") == b"idle"
            and r.zscore(keys.WORKERS, "stale") is not None
        ),
        10,
        what="the stale worker to rejoin",
    )
    done = wait_status(http, task_id, {"succeeded"}, timeout_s=20)
    assert (done["worker"], done["attempts"]) == ("other", 2)
    # It serves again: with "other" stopped, a new task runs on "stale".
    other.terminate()
    again = http.post("/tasks", json={"type": "echo", "args": {}}).json()["id"]
    assert wait_status(http, again, {"succeeded"})["worker"] == "stale"


@pytest.mark.slow
def test_a_stalled_batch_stops_its_stale_run_and_the_worker_lives(
    known_types: None, r: redis.Redis, http: httpx.Client, start_worker: WorkerFactory
) -> None:
    """The same stall with a batch in progress: every item is run again elsewhere, the
    stale worker abandons the whole call (none of its items is reported) and serves on."""
    body = {"type": "test.batch_echo", "args": {"value": 0, "seconds": 6}}
    ids = []
    for value in range(3):
        body["args"] = {"value": value, "seconds": 6}
        response = http.post("/tasks", json=body)
        assert response.status_code == 202, response.text
        ids.append(response.json()["id"])
    stale = start_worker("stale-batch")
    wait_for(
        lambda: all(r.hget(keys.job(i), "worker_name") == b"stale-batch" for i in ids),
        10,
        what="one batch of all three on the stale worker",
    )
    os.kill(stale.pid, signal.SIGSTOP)
    try:
        start_worker("other-batch")
        wait_for(
            lambda: all(r.hget(keys.job(i), "worker_name") == b"other-batch" for i in ids),
            15,
            what="the batch to run again",
        )
    finally:
        os.kill(stale.pid, signal.SIGCONT)
    wait_for(lambda: "task abandoned" in stale.output(), 10, what="the stale batch to end")
    assert stale.alive(), stale.output()
    for task_id in ids:
        done = wait_status(http, task_id, {"succeeded", "failed"}, timeout_s=20)
        assert (done["status"], done["worker"], done["attempts"]) == (
            "succeeded",
            "other-batch",
            2,
        )
    wait_for(
        lambda: r.hget(keys.worker("stale-batch"), "state") == b"idle",
        10,
        what="the stale worker to serve again",
    )
