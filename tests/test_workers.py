"""Workers: class priority, class pinning, sharing a queue, refusing foreign jobs."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import redis
from conftest import WorkerFactory, make_settings, submit, wait_status
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer
from support.catalog import publish_builtin_catalog

from dispatcher.contract import keys
from dispatcher.contract.jobs import ENTRY_POINT
from dispatcher.contract.settings import ClassConfig
from testkit import ApiServer, run_cli, wait_for, worker_env


def _ran(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def test_interactive_runs_before_queued_batch(
    redis_url: str,
    r: redis.Redis,
    api_factory: Callable[..., ApiServer],
    start_worker: WorkerFactory,
    tmp_path: Path,
) -> None:
    # Both classes queue while no worker runs; then one worker starts and drains them,
    # each task appending its tag to one file: the order they really ran in.
    publish_builtin_catalog(r)
    open_classes = {"interactive": ClassConfig(), "batch": ClassConfig()}
    api = api_factory(make_settings(redis_url, classes=open_classes))
    order = tmp_path / "order"
    with httpx.Client(base_url=api.url, timeout=10) as http:
        for cls, prefix in (("batch", "b"), ("interactive", "i")):
            for n in range(3):
                submit(http, "test.record", {"path": str(order), "tag": f"{prefix}{n}"}, cls=cls)
        start_worker()
        wait_for(lambda: len(_ran(order)) == 6, 15, what="all six tasks to run")
    # Interactive first, FIFO within each class.
    assert _ran(order) == ["i0", "i1", "i2", "b0", "b1", "b2"]


def test_interactive_only_worker_never_takes_batch(
    http: httpx.Client, r: redis.Redis, start_worker: WorkerFactory
) -> None:
    worker = start_worker(classes="interactive")
    batch = [submit(http, "echo", {"n": i}, cls="batch") for i in range(3)]
    interactive = [submit(http, "echo", {"n": i}, cls="interactive") for i in range(3)]
    for task in interactive:
        assert wait_status(http, task["id"], {"succeeded"})["worker"] == worker.name
    for position, task in enumerate(batch):
        record = http.get(f"/tasks/{task['id']}").json()
        assert record["status"] == "queued" and record["position"] == position
    assert r.llen(keys.queue("batch")) == 3
    listed = http.get("/workers").json()["workers"]
    assert [w["classes"] for w in listed] == [["interactive"]]


def test_two_workers_drain_one_queue(http: httpx.Client, start_worker: WorkerFactory) -> None:
    a, b = start_worker("drain-a"), start_worker("drain-b")
    tasks = [submit(http, "sleep", {"seconds": 0.2}) for _ in range(10)]
    records = [wait_status(http, t["id"], {"succeeded"}, timeout_s=30) for t in tasks]
    by_worker = {name: sum(r["worker"] == name for r in records) for name in (a.name, b.name)}
    assert sum(by_worker.values()) == 10
    assert min(by_worker.values()) >= 3, by_worker  # both pulled; neither idled
    done = {w["name"]: w["tasks_done"] for w in http.get("/workers").json()["workers"]}
    wait_for(
        lambda: (
            {w["name"]: w["tasks_done"] for w in http.get("/workers").json()["workers"]}
            == by_worker
        ),
        5,
        what=f"tasks_done to match {by_worker} (saw {done})",
    )


def test_workers_route_shows_current_task(http: httpx.Client, start_worker: WorkerFactory) -> None:
    worker = start_worker()
    task = submit(http, "sleep", {"seconds": 1.0})
    wait_status(http, task["id"], {"running"})
    entry = wait_for(
        lambda: next(
            (w for w in http.get("/workers").json()["workers"] if w["state"] == "busy"), None
        ),
        5,
        what="a busy worker",
    )
    assert entry["name"] == worker.name
    assert entry["current_task"] == task["id"]
    assert {
        "name",
        "host",
        "state",
        "classes",
        "task_types",
        "current_task",
        "tasks_done",
        "tasks_failed",
        "last_heartbeat",
        "device",
    } <= set(entry)
    assert {"echo", "sleep", "document.extract", "test.env"} <= set(entry["task_types"])
    assert entry["device"]["kind"] == "cpu" and entry["device"]["index"] is None
    queues = http.get("/queues").json()["classes"]
    assert [c["name"] for c in queues] == ["interactive", "batch"]
    batch = queues[1]
    assert batch["running"] == 1 and batch["workers"] == 1 and batch["busy_workers"] == 1


def test_foreign_entry_point_is_refused(
    http: httpx.Client, r: redis.Redis, start_worker: WorkerFactory, tmp_path: Path
) -> None:
    """A job naming any function but gpulane's entry point never runs (invariant 3)."""
    victim = tmp_path / "victim.txt"
    victim.write_text("still here")
    job = Queue("batch", connection=r, serializer=JSONSerializer).enqueue("os.remove", str(victim))
    pickled = Queue("batch", connection=r).enqueue("os.remove", str(victim))  # pickle serializer
    worker = start_worker()
    for foreign in (job, pickled):
        record = wait_status(http, foreign.id, {"failed"})
        assert record["error"]["code"] == "refused"
    assert victim.read_text() == "still here"
    assert worker.alive()
    fetched = Job.fetch(job.id, connection=r, serializer=JSONSerializer)
    assert fetched.get_status() == "failed"


def test_unregistered_type_in_a_valid_call_is_refused(
    http: httpx.Client, r: redis.Redis, start_worker: WorkerFactory
) -> None:
    job = Queue("batch", connection=r, serializer=JSONSerializer).enqueue(
        ENTRY_POINT, "shell.exec", {"cmd": "true"}
    )
    start_worker()
    record = wait_status(http, job.id, {"failed"})
    assert record["error"]["code"] == "unknown_task_type"
    assert "shell.exec" in record["error"]["message"]


def test_cpu_worker_hides_gpus_from_tasks(http: httpx.Client, start_worker: WorkerFactory) -> None:
    start_worker()
    result = wait_status(http, submit(http, "test.env")["id"], {"succeeded"})["result"]
    assert result["cuda_visible_devices"] == ""  # pinned to no GPU before task code loaded
    assert result["device"]["kind"] == "cpu"


def test_cancel_queued_task(http: httpx.Client, start_worker: WorkerFactory) -> None:
    start_worker(classes="interactive")
    task = submit(http, "echo", cls="batch")
    response = http.delete(f"/tasks/{task['id']}")
    assert response.status_code == 200
    record = response.json()
    assert record["status"] == "canceled" and record["error"]["code"] == "canceled"
    assert http.get(f"/tasks/{task['id']}").json()["status"] == "canceled"
    assert http.get("/queues").json()["classes"][1]["depth"] == 0
    assert http.delete(f"/tasks/{task['id']}").status_code == 409


def test_duplicate_name_waits_then_gives_up(start_worker: WorkerFactory) -> None:
    first = start_worker("same-name")
    second = start_worker("same-name", wait=False)
    assert second.process.wait(20) == 2
    assert "already named 'same-name'" in second.output()
    assert first.alive()


def test_worker_is_capacity_as_soon_as_it_registered(
    http: httpx.Client, r: redis.Redis, start_worker: WorkerFactory
) -> None:
    """No heartbeat needed before an interactive submit is admitted (a slow heartbeat
    here: the state must come from the registration itself)."""
    worker = start_worker("fresh", wait=False, heartbeat_interval_s=5, lease_ttl_s=15)

    def registered_with_tasks() -> bool:
        return b"echo" in (r.hget(keys.worker(worker.name), "task_types") or b"")

    wait_for(registered_with_tasks, 20, interval_s=0.01, what="the worker's final registration")
    response = http.post("/tasks", json={"type": "echo", "class": "interactive"})
    assert response.status_code == 202, response.text
    assert wait_status(http, response.json()["id"], {"succeeded"})["worker"] == worker.name


@pytest.mark.parametrize(
    ("modules", "needle"),
    [
        ("nosuch.mod", "task module 'nosuch.mod' cannot be imported: ModuleNotFoundError"),
        ("broken_tasks", "task module 'broken_tasks' cannot be imported: ImportError: needs torch"),
        ("worker.tasks", "declare no @task"),  # a package with no task in it
    ],
)
@pytest.mark.parametrize("given", ["flag", "env"])
def test_a_worker_without_usable_task_modules_refuses_to_start(
    redis_url: str, r: redis.Redis, tmp_path: Path, modules: str, needle: str, given: str
) -> None:
    """A configuration mistake: exit 2 with one error line naming the module and why,
    no traceback, and no worker left registered to claim tasks it cannot run."""
    (tmp_path / "broken_tasks.py").write_text("raise ImportError('needs\\ntorch')\n")
    env = worker_env(redis_url, heartbeat_interval_s=0.2, lease_ttl_s=1)
    env["PYTHONPATH"] += f":{tmp_path}"
    args = ["worker", "--gpu", "none", "--name", "no-tasks", "--classes", "batch"]
    if given == "flag":
        args += ["--tasks", modules]
    else:
        env["GPULANE_TASK_MODULES"] = json.dumps([modules])
    done = run_cli(*args, env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    output = done.stdout + done.stderr
    assert "Traceback" not in output
    errors = [line for line in output.splitlines() if needle in line]
    assert len(errors) == 1, output
    assert r.zscore(keys.WORKERS, "no-tasks") is None
    assert not r.exists(keys.worker("no-tasks"))
