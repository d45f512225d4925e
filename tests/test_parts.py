"""Tasks that split into parts (``ctx.map``): fan-out over the pool, fan-in in order,
failure, cancel, a lost worker, results stored in parts. Real Redis, real API, real
worker processes (``test.map`` splits into ``test.part`` parts)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from conftest import WorkerFactory, make_settings, submit, wait_status

from dispatcher.client import Client
from dispatcher.contract import keys
from dispatcher.contract.parts import part_id
from dispatcher.contract.settings import Settings
from testkit import ApiServer, wait_for

FINAL = {"succeeded", "failed", "canceled"}


def _entry(i: int, parent: str) -> dict[str, Any]:
    return {"index": i, "parent": parent, "values": [i, -i]}


def test_a_task_splits_over_the_pool_and_merges_in_order(
    known_types: None, http: httpx.Client, r: redis.Redis, start_worker: WorkerFactory
) -> None:
    start_worker("left")
    start_worker("right")
    task = submit(http, "test.map", {"parts": 8, "seconds": 0.4})
    record = wait_status(http, task["id"], {"succeeded"}, 30)
    assert record["result"] == {
        "parts": 8,
        "workers": 2,  # what ctx.workers() saw: both serve the class
        "values": [_entry(i, task["id"]) for i in range(8)],
    }
    assert record["parts"]["count"] == 8 and record["parts"]["done"] == 8
    assert record["parts"]["entries"] == 8 and record["parts"]["bytes"] > 0
    assert record["progress"] == {"fraction": 1.0, "message": "8 of 8 parts done"}
    assert record["result_url"] is None  # small enough to be in the record
    parts = [http.get(f"/tasks/{part_id(task['id'], i)}").json() for i in range(8)]
    assert [p["part"] for p in parts] == list(range(8))
    assert {p["parent"] for p in parts} == {task["id"]}
    assert [p["result"] for p in parts] == [_entry(i, task["id"]) for i in range(8)]
    assert {p["worker"] for p in parts} == {"left", "right"}  # the pool shared them
    # The parts ran for the parent's tenant (quotas, fair share and usage charge it).
    tenant = r.hget(keys.job(task["id"]), "tenant")
    assert {r.hget(keys.job(part_id(task["id"], i)), "tenant") for i in range(8)} == {tenant}
    # The whole result read on its own is the same.
    assert http.get(f"/tasks/{task['id']}/result").json() == record["result"]


def test_flattened_parts_read_back_by_range(
    known_types: None, http: httpx.Client, start_worker: WorkerFactory
) -> None:
    start_worker()
    task = submit(http, "test.map", {"parts": 4, "flatten": True})
    record = wait_status(http, task["id"], {"succeeded"}, 20)
    assert record["result"]["values"] == [0, 0, 1, -1, 2, -2, 3, -3]
    assert record["parts"]["entries"] == 8
    ranged = http.get(f"/tasks/{task['id']}/result", params={"pages": "2-5"})
    assert ranged.status_code == 200, ranged.text
    assert ranged.json() == {"parts": 4, "workers": 1, "values": [0, 1, -1, 2]}
    assert http.get(f"/tasks/{task['id']}/result?pages=8").json()["values"] == [-3]
    past = http.get(f"/tasks/{task['id']}/result", params={"pages": "5-9"})
    assert past.status_code == 416 and "1-8" in past.json()["message"]
    assert past.json()["error"] == "range_not_satisfiable" and past.json()["entries"] == 8
    # A range no result can hold is the same answer; one that is not a range is a 422.
    backwards = http.get(f"/tasks/{task['id']}/result", params={"pages": "5-2"})
    assert backwards.status_code == 416, backwards.text
    assert http.get(f"/tasks/{task['id']}/result?pages=x").status_code == 422
    # A task that did not split has its result whole, never by range.
    plain = submit(http, "echo", {"a": 1})
    wait_status(http, plain["id"], {"succeeded"})
    assert http.get(f"/tasks/{plain['id']}/result").json() == {"a": 1}
    assert http.get(f"/tasks/{plain['id']}/result?pages=1").status_code == 416
    running = submit(http, "sleep", {"seconds": 5})
    assert http.get(f"/tasks/{running['id']}/result").status_code == 409
    assert http.get("/tasks/no-such-task/result").status_code == 404


def test_a_failing_part_fails_its_task_and_stops_the_others(
    known_types: None, http: httpx.Client, start_worker: WorkerFactory
) -> None:
    start_worker()
    task = submit(http, "test.map", {"parts": 5, "seconds": 0.2, "fail_part": 1})
    record = wait_status(http, task["id"], {"failed"}, 20)
    assert record["error"]["code"] == "part_broke" and record["error"]["part"] == 1
    assert "Part 1 of 5" in record["error"]["message"]
    assert "part 1 broke" in record["error"]["message"]
    parts = [wait_status(http, part_id(task["id"], i), FINAL) for i in range(5)]
    assert [p["status"] for p in parts] == [
        "succeeded",
        "failed",
        "canceled",
        "canceled",
        "canceled",
    ]
    assert parts[0]["result"] == _entry(0, task["id"])  # what it stored stays readable


def test_canceling_a_task_cancels_its_parts(
    known_types: None, http: httpx.Client, start_worker: WorkerFactory
) -> None:
    start_worker()
    task = submit(http, "test.map", {"parts": 4, "seconds": 20})
    first = part_id(task["id"], 0)
    wait_status(http, first, {"running"})
    refused = http.delete(f"/tasks/{first}")
    assert refused.status_code == 409 and refused.json()["error"] == "part_of_task"
    assert refused.json()["parent"] == task["id"]
    canceled = http.delete(f"/tasks/{task['id']}")
    assert canceled.status_code == 200 and canceled.json()["status"] == "canceled"
    parts = [wait_status(http, part_id(task["id"], i), {"canceled"}) for i in range(4)]
    assert parts[0]["attempts"] == 1  # stopped by its worker, not run to its end
    assert all(p["attempts"] == 0 for p in parts[1:])  # never started


def test_a_worker_killed_mid_part_redoes_that_part_only(
    known_types: None,
    http: httpx.Client,
    r: redis.Redis,
    start_worker: WorkerFactory,
    tmp_path: Path,
) -> None:
    runs = tmp_path / "runs"
    doomed = start_worker("doomed")
    task = submit(http, "test.map", {"parts": 4, "seconds": 1.0, "path": str(runs)})
    # Killed once part 1's handler has begun (its first act writes its line), not at
    # its claim: the record says running from the claim on, and a kill before the
    # handler's first line would leave that run unrecorded (a flake seen once).
    wait_for(lambda: runs.exists() and "1" in runs.read_text().split(), 20, "part 1 to run")
    doomed.kill()
    start_worker("heir")
    record = wait_status(http, task["id"], {"succeeded"}, 40)
    assert [v["index"] for v in record["result"]["values"]] == [0, 1, 2, 3]
    lines = runs.read_text().split()
    assert sorted(lines) == ["0", "1", "1", "2", "3"]  # part 1 ran twice, the others once
    attempts = [http.get(f"/tasks/{part_id(task['id'], i)}").json()["attempts"] for i in range(4)]
    assert attempts == [1, 2, 1, 1]


@pytest.fixture
def settings(redis_url: str) -> Settings:
    # Small results for every test here: 60 parts' entries pass it, 8 do not.
    return make_settings(redis_url, max_result_bytes=2048)


def test_a_result_past_max_result_bytes_is_read_from_its_parts(
    known_types: None, http: httpx.Client, start_worker: WorkerFactory, api: ApiServer
) -> None:
    start_worker()
    task = submit(http, "test.map", {"parts": 60})  # about 3 KB merged
    record = wait_status(http, task["id"], {"succeeded"}, 30)
    assert record["result"] is None
    assert record["result_url"] == f"/tasks/{task['id']}/result"
    whole = http.get(record["result_url"]).json()
    assert [v["index"] for v in whole["values"]] == list(range(60))
    # The client reads it for the caller: wait() returns the result whole.
    with Client(api.url) as client:
        waited = client.wait(task["id"], timeout_s=10)
        assert waited["result"] == whole
        assert client.result(task["id"], pages="60")["values"] == [_entry(59, task["id"])]


def test_progress_is_the_parts_sum(
    known_types: None, http: httpx.Client, start_worker: WorkerFactory
) -> None:
    start_worker()
    task = submit(http, "test.map", {"parts": 2, "seconds": 3})

    def midway() -> dict[str, Any] | None:
        record: dict[str, Any] = http.get(f"/tasks/{task['id']}").json()
        progress = record["progress"] or {}
        return record if 0.1 < progress.get("fraction", 0) < 0.5 else None

    record = wait_for(midway, 10, what="progress inside the first part")
    assert record["status"] == "running"
    assert record["progress"]["message"] == "0 of 2 parts done"

    def second_half() -> dict[str, Any] | None:
        record: dict[str, Any] = http.get(f"/tasks/{task['id']}").json()
        progress = record["progress"] or {}
        return record if 0.5 < progress.get("fraction", 0) < 1 else None

    record = wait_for(second_half, 10, what="progress inside the second part")
    assert record["progress"]["message"] == "1 of 2 parts done"
    assert record["parts"]["done"] == 1
