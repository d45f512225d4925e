"""RQ's own tools see the pool: the real `rq info` command and rq's Python API list
gpulane's workers (name, queues, state, current job, heartbeat), read its queues and
job hashes without crashing, and drop a worker that exits or dies."""

from __future__ import annotations

import shutil
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path

import httpx
import redis
from conftest import WorkerFactory, submit, wait_status
from rq import Queue, Worker
from rq.serializers import JSONSerializer

from dispatcher.contract import keys
from testkit import wait_for

_VENV_RQ = Path(sys.executable).parent / "rq"  # installed with rq, next to this Python
RQ = str(_VENV_RQ) if _VENV_RQ.exists() else "rq"


def rq_info(redis_url: str, *args: str) -> str:
    """`rq info` as an operator runs it; fails the test if it fails."""
    assert shutil.which(RQ), "the `rq` command (installed with rq) is missing"
    done = subprocess.run(
        [RQ, "info", "--url", redis_url, *args], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def worker_lines(output: str) -> dict[str, str]:
    """`rq info --raw` worker lines by worker name."""
    lines = [line for line in output.splitlines() if line.startswith("worker ")]
    return {line.split()[1]: line for line in lines}


def rq_workers(r: redis.Redis) -> dict[str, Worker]:
    return {w.name: w for w in Worker.all(connection=r)}


def test_rq_info_lists_workers_with_state_and_current_job(
    http: httpx.Client, start_worker: WorkerFactory, r: redis.Redis, redis_url: str
) -> None:
    busy = start_worker("gpu-a", classes="batch")
    idle = start_worker("gpu-b", classes="interactive")
    task = submit(http, "sleep", {"seconds": 3.0})
    queued = [submit(http, "sleep", {"seconds": 3.0}) for _ in range(2)]  # wait behind it
    wait_status(http, task["id"], {"running"})
    # The heartbeat publishes the running task within one beat.
    wait_for(
        lambda: (
            ws
            if (ws := rq_workers(r)).keys() == {busy.name, idle.name}
            and ws[busy.name].get_current_job_id() == task["id"]
            else None
        ),
        5,
        what="rq's Worker.all to see both workers and the running job",
    )
    # Read again: rq's Worker.all snapshots the hash (state) but get_current_job_id
    # reads the executions live, so the snapshot above may predate the beat that
    # published the task. One beat writes both; a read after it sees them together.
    workers = rq_workers(r)
    a, b = workers[busy.name], workers[idle.name]
    assert (a.get_state(), b.get_state()) == ("busy", "idle")
    assert a.queue_names() == ["batch"] and b.queue_names() == ["interactive"]
    assert a.pid == busy.pid and b.pid == idle.pid
    assert b.get_current_job_id() is None
    assert a.birth_date is not None and a.last_heartbeat is not None
    assert a.last_heartbeat >= a.birth_date
    job = a.get_current_job()  # RQ reads gpulane's job hash through the execution
    assert job is not None and job.id == task["id"] and job.get_status() == "started"
    assert Worker.count(queue=Queue("batch", connection=r)) == 1

    raw = rq_info(redis_url, "--raw")
    lines = worker_lines(raw)
    assert set(lines) == {busy.name, idle.name}, raw
    assert " busy batch." in lines[busy.name] and f" {busy.pid})" in lines[busy.name]
    assert " idle interactive." in lines[idle.name]
    assert "queue batch 2," in raw and "queue interactive 0," in raw  # LLEN of rq:queue:*
    by_queue = rq_info(redis_url, "--by-queue", "batch", "interactive")
    assert "batch:" in by_queue and f"{busy.name} (busy)" in by_queue
    assert f"{idle.name} (idle)" in by_queue

    for t in (task, *queued):
        wait_status(http, t["id"], {"succeeded"}, timeout_s=30)
    # The count and the state come from the worker's heartbeats: a beat may publish the
    # third task counted while the loop has not parked yet (still busy); wait for both.
    done = wait_for(
        lambda: (
            w
            if (w := rq_workers(r)[busy.name]).successful_job_count == 3 and w.get_state() == "idle"
            else None
        ),
        5,
        what="the finished count and the idle state in RQ's registry",
    )
    assert done.get_current_job_id() is None
    assert r.scard(keys.rq_worker_executions(busy.name)) == 0  # the execution went with it
    assert "jobs: 3 finished, 0 failed" in worker_lines(rq_info(redis_url, "--raw"))[busy.name]


def test_rq_registry_entries_expire_with_the_lease(
    start_worker: WorkerFactory, r: redis.Redis, redis_url: str
) -> None:
    """RQ's cleanup drops names whose hash expired: the heartbeat keeps it alive, and a
    worker SIGKILLed with nobody left to reap it still leaves RQ's registry."""
    worker = start_worker("lonely")
    key = keys.rq_worker(worker.name)
    assert 0 < r.pttl(key) <= 1000  # the lease (tests: 1 s), renewed by every beat (0.2 s)

    def beat_at() -> datetime:
        return datetime.fromisoformat(r.hget(key, "last_heartbeat").decode())

    first = beat_at()
    wait_for(
        lambda: beat_at() - first > timedelta(seconds=1.5) or None,
        5,
        what="heartbeats keeping RQ's hash for longer than its TTL",
    )
    rq_info(redis_url)  # runs RQ's clean_worker_registry past the TTL: a live worker stays
    assert 0 < r.pttl(key) <= 1000
    assert set(rq_workers(r)) == {worker.name}
    assert r.sismember(keys.RQ_WORKERS, key) and r.sismember(keys.rq_workers_of("batch"), key)

    worker.kill()  # no API and no other worker: no reaper runs
    wait_for(lambda: not r.exists(key), 10, what="the worker's RQ hash to expire")
    assert worker_lines(rq_info(redis_url, "--raw")) == {}
    assert r.scard(keys.RQ_WORKERS) == 0 and r.scard(keys.rq_workers_of("batch")) == 0


def test_killed_worker_is_reaped_from_rq_registry(
    http: httpx.Client, start_worker: WorkerFactory, r: redis.Redis
) -> None:
    """With a reaper running (the API's maintenance), a SIGKILLed busy worker leaves
    RQ's registry with its lease, execution and all; a clean exit leaves at once."""
    victim = start_worker("victim")
    task = submit(http, "sleep", {"seconds": 30.0})
    wait_status(http, task["id"], {"running"})
    wait_for(
        lambda: r.scard(keys.rq_worker_executions(victim.name)) == 1 or None,
        5,
        what="RQ's execution of the running task",
    )
    victim.kill()
    wait_for(lambda: r.scard(keys.RQ_WORKERS) == 0 or None, 5, what="the reaper")
    assert not r.exists(keys.rq_worker(victim.name))
    assert not r.exists(keys.rq_worker_executions(victim.name))
    assert not r.keys("rq:execution:*")
    assert rq_workers(r) == {}

    # A long lease: only unregister can remove it this fast. (Interactive only: the
    # victim's task went back to the batch queue.)
    calm = start_worker("calm", classes="interactive", lease_ttl_s=60)
    assert 30_000 < r.pttl(keys.rq_worker(calm.name)) <= 60_000
    assert calm.terminate() == 0
    assert not r.exists(keys.rq_worker(calm.name))
    assert r.scard(keys.RQ_WORKERS) == 0
    assert r.scard(keys.rq_workers_of("interactive")) == 0


def test_rq_reads_gpulane_jobs_in_every_status(
    http: httpx.Client, start_worker: WorkerFactory, r: redis.Redis, redis_url: str
) -> None:
    """`rq info` and rq's Queue read queued, running and final gpulane jobs (JSON
    serializer) without crashing."""
    start_worker()
    ok = submit(http, "echo", {"x": 1})
    wait_status(http, ok["id"], {"succeeded"})
    bad = submit(http, "test.fail", {})
    wait_status(http, bad["id"], {"failed"})
    running = submit(http, "sleep", {"seconds": 5.0})
    wait_status(http, running["id"], {"running"})
    waiting = submit(http, "sleep", {"seconds": 5.0})
    queue = Queue("batch", connection=r, serializer=JSONSerializer)
    assert queue.job_ids == [waiting["id"]]
    jobs = queue.get_jobs()
    assert [j.id for j in jobs] == [waiting["id"]] and jobs[0].get_status() == "queued"
    output = rq_info(redis_url, "-S", "json")
    assert "batch" in output and "1 workers" in output
