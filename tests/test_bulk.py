"""Bulk submit (``POST /tasks`` with a JSON array or JSON Lines) and chunks: a request's
items travel together. Real Redis, real API, real worker processes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from conftest import WorkerFactory, make_settings, wait_status
from support.catalog import tenant
from support.observe import scrape

from dispatcher.contract import keys
from dispatcher.contract.settings import ClassConfig, Settings
from testkit import wait_for

ECHO = "test.batch_echo"  # batched, max size 4: items pack into chunks of 4
FINAL = {"succeeded", "failed", "canceled"}


@pytest.fixture
def settings(redis_url: str) -> Settings:
    return make_settings(
        redis_url,
        classes={"interactive": ClassConfig(max_wait_s=30), "batch": ClassConfig(max_queued=50)},
    )


def _echoes(n: int, path: Path | None = None, **args: Any) -> list[dict[str, Any]]:
    extra = {"path": str(path)} if path else {}
    return [{"type": ECHO, "args": {"value": i, **extra, **args}} for i in range(n)]


def _bulk(http: httpx.Client, tasks: list[dict[str, Any]], status: int = 202) -> dict[str, Any]:
    response = http.post("/tasks", json=tasks)
    assert response.status_code == status, response.text
    body: dict[str, Any] = response.json()
    return body


def _queued(r: redis.Redis, cls: str = "batch") -> tuple[int, int]:
    """(records listed, items queued) in the class."""
    listed = r.llen(keys.queue(cls))
    return listed, listed + int(r.get(keys.queued_extra(cls)) or 0)


def test_a_bulk_of_a_batched_type_packs_into_chunks_and_reads_per_item(
    known_types: None,
    http: httpx.Client,
    r: redis.Redis,
    start_worker: WorkerFactory,
    tmp_path: Path,
) -> None:
    log = tmp_path / "calls"
    body = _bulk(http, _echoes(10, log))
    assert body["count"] == 10 and len(body["ids"]) == 10 and body["class"] == "batch"
    chunks = sorted({i.rpartition(".")[0] for i in body["ids"]})
    assert len(chunks) == 3  # 4 + 4 + 2 items
    assert _queued(r) == (3, 10)
    queued = http.get(f"/tasks/{body['ids'][5]}").json()
    assert queued["status"] == "queued" and queued["chunk"] in chunks
    start_worker()
    records = [wait_status(http, i, FINAL, 30) for i in body["ids"]]
    assert [rec["result"] for rec in records] == [{"value": i} for i in range(10)]
    assert [rec["id"] for rec in records] == body["ids"]
    assert all(rec["status"] == "succeeded" for rec in records)
    # Each chunk ran as one batch (the worker's batch is 4 items: two chunks never share).
    calls = [line.split() for line in log.read_text().splitlines()]
    assert sorted(calls) == sorted([["0", "1", "2", "3"], ["4", "5", "6", "7"], ["8", "9"]])
    assert _queued(r) == (0, 0)
    whole = http.get(f"/tasks/{chunks[0]}").json()
    assert whole["items"] in (2, 4) and len(whole["result"]["results"]) == whole["items"]


def test_an_item_that_fails_fails_alone_in_its_chunk(
    known_types: None, http: httpx.Client, start_worker: WorkerFactory
) -> None:
    tasks = _echoes(4)
    tasks[2]["args"]["fail"] = True
    body = _bulk(http, tasks)
    start_worker()
    records = [wait_status(http, i, FINAL, 30) for i in body["ids"]]
    assert [rec["status"] for rec in records] == ["succeeded", "succeeded", "failed", "succeeded"]
    assert records[2]["error"] == {"code": "bad_item", "message": "item 2 fails"}
    assert records[2]["result"] is None and records[3]["result"] == {"value": 3}


def test_json_lines_and_unbatched_tasks_each_get_their_own_record(
    known_types: None, http: httpx.Client, r: redis.Redis, start_worker: WorkerFactory
) -> None:
    lines = [json.dumps({"type": "echo", "args": {"n": i}}) for i in range(5)]
    response = http.post(
        "/tasks", content="\n".join(lines) + "\n", headers={"content-type": "application/x-ndjson"}
    )
    assert response.status_code == 202, response.text
    ids = response.json()["ids"]
    assert len(ids) == 5 and all("." not in i for i in ids)  # a task each: spread over workers
    assert _queued(r) == (5, 5)
    start_worker()
    assert [wait_status(http, i, FINAL)["result"] for i in ids] == [{"n": i} for i in range(5)]


def test_an_invalid_task_refuses_the_whole_bulk_naming_its_index(
    known_types: None, http: httpx.Client, r: redis.Redis
) -> None:
    tasks = _echoes(6)
    tasks[3]["args"] = {"value": "not a number"}
    body = _bulk(http, tasks, 422)
    assert body["index"] == 3 and body["message"].startswith("tasks[3]:")
    tasks[3] = {"type": "no.such.type"}
    assert _bulk(http, tasks, 422)["error"] == "unknown_task_type"
    tasks[3] = {"type": ECHO, "class": "interactive", "args": {"value": 3}}
    assert "one class" in _bulk(http, tasks, 422)["message"]
    assert _queued(r) == (0, 0)  # nothing was enqueued by any of them


def test_bulk_limits_count_items(known_types: None, http: httpx.Client, r: redis.Redis) -> None:
    # max_queued is 50 items: more than that in one request can never fit (422) ...
    assert _bulk(http, _echoes(51), 422)["error"] == "too_many_items"
    # ... 40 fit, and 11 more are refused for now (503 with Retry-After), whole.
    _bulk(http, _echoes(40))
    refused = http.post("/tasks", json=_echoes(11))
    assert refused.status_code == 503 and refused.json()["error"] == "queue_full"
    assert "retry-after" in refused.headers
    assert _queued(r) == (10, 40)
    _bulk(http, _echoes(10))
    assert _queued(r)[1] == 50
    assert http.get("/queues").json()["classes"][1]["depth"] == 50
    assert http.post("/tasks", json={"type": ECHO, "args": {"value": 1}}).status_code == 503


def test_a_bulk_that_no_quota_could_hold_is_a_422(
    known_types: None, redis_url: str, api_factory: Any, r: redis.Redis
) -> None:
    api = api_factory(make_settings(redis_url, tenants=[tenant("t", "k" * 20, max_in_flight=5)]))
    with httpx.Client(base_url=api.url, headers={"authorization": "Bearer " + "k" * 20}) as http:
        tasks = [{"type": "echo", "args": {"n": i}} for i in range(6)]
        body = _bulk(http, tasks, 422)
        assert body["error"] == "too_many_items" and body["max_in_flight"] == 5
    assert _queued(r) == (0, 0)


def test_bulk_refuses_idempotency_keys_and_empty_bodies(
    known_types: None, http: httpx.Client
) -> None:
    response = http.post("/tasks", json=_echoes(2), headers={"Idempotency-Key": "k1"})
    assert response.status_code == 422 and "Idempotency-Key" in response.json()["message"]
    assert http.post("/tasks", json=[]).status_code == 400


def test_an_item_of_a_chunk_is_canceled_with_its_chunk(
    known_types: None, http: httpx.Client, r: redis.Redis
) -> None:
    ids = _bulk(http, _echoes(3))["ids"]
    item = http.delete(f"/tasks/{ids[1]}")
    assert item.status_code == 409 and item.json()["error"] == "part_of_chunk"
    chunk = item.json()["chunk"]
    assert http.delete(f"/tasks/{chunk}").status_code == 200
    assert [http.get(f"/tasks/{i}").json()["status"] for i in ids] == ["canceled"] * 3
    assert _queued(r) == (0, 0)
    assert http.get(f"/tasks/{chunk}.3").status_code == 404  # past its items

    def canceled() -> float | None:  # the chunk's three items, not one record
        labels = {"class": "batch", "type": ECHO, "status": "canceled"}
        return scrape(http).value("gpulane_tasks_finished_total", **labels)

    assert wait_for(lambda: canceled() == 3, 10, what="3 items canceled in the metrics")


def test_a_worker_killed_mid_chunk_loses_no_item(
    known_types: None, http: httpx.Client, r: redis.Redis, start_worker: WorkerFactory
) -> None:
    ids = _bulk(http, _echoes(4, seconds=1.0))["ids"]
    chunk = ids[0].rpartition(".")[0]
    doomed = start_worker("doomed")
    wait_for(lambda: r.hget(keys.job(chunk), "status") == b"started", 15, what="chunk started")
    doomed.kill()  # SIGKILL mid-call
    start_worker("heir")
    records = [wait_status(http, i, FINAL, 30) for i in ids]
    assert [rec["result"] for rec in records] == [{"value": i} for i in range(4)]
    assert {rec["worker"] for rec in records} == {"heir"}
    assert all(rec["attempts"] == 2 for rec in records)  # the chunk's lease, per item

    def requeued() -> float | None:  # the reaper counts the chunk's items, not 1
        labels = {"class": "batch", "reason": "worker_lost"}
        return scrape(http).value("gpulane_tasks_requeued_total", **labels)

    assert wait_for(lambda: requeued() == 4, 10, what="4 items requeued in the metrics")


def test_bulk_size_limits_are_a_single_tasks_per_task(
    known_types: None, http: httpx.Client, r: redis.Redis
) -> None:
    big = "x" * (1024 * 1024)  # one task over max_body_bytes (1 MiB), inside a bulk
    response = http.post(
        "/tasks", json=[{"type": "echo", "args": {"n": 1}}, {"type": "echo", "args": {"s": big}}]
    )
    assert response.status_code == 413 and response.json()["index"] == 1
    # A single task's body is refused past max_body_bytes, not the bulk limit.
    single = http.post("/tasks", json={"type": "echo", "args": {"s": big}})
    assert single.status_code == 413 and single.json()["limit_bytes"] == 1024 * 1024
    assert _queued(r) == (0, 0)


def test_retry_after_waits_for_room_for_the_whole_request(
    known_types: None, http: httpx.Client, r: redis.Redis, start_worker: WorkerFactory
) -> None:
    start_worker()
    ids = _bulk(http, _echoes(40, seconds=20))["ids"]  # one chunk runs, 36 items wait
    wait_for(lambda: _queued(r) == (9, 36), 15, what="the worker to take one chunk")
    assert http.get(f"/tasks/{ids[0]}").json()["status"] == "running"

    def small_refused() -> httpx.Response | None:
        # Refused while the API's cached view of the pool (one heartbeat old at most)
        # predates the worker: estimated wait -1, Retry-After the no-worker 5 s.
        response = http.post("/tasks", json=_echoes(15))
        return response if response.headers["gpulane-estimated-wait"] != "-1" else None

    small = wait_for(small_refused, 10, what="the API to see the worker")
    big = http.post("/tasks", json=_echoes(30))
    assert big.status_code == small.status_code == 503
    # 30 items need 16 drained before they fit, 15 need 1: the first waits longer.
    assert int(big.headers["retry-after"]) > int(small.headers["retry-after"]) >= 1


def test_a_bulk_takes_what_a_single_submit_takes(known_types: None, http: httpx.Client) -> None:
    """Integers past 64 bits and non-ASCII text round-trip as in a single POST /tasks."""
    args = {"n": 10**40, "s": "日本語 ☃ 𝄞"}
    ids = _bulk(http, [{"type": "echo", "args": args}] * 2)["ids"]
    assert http.get(f"/tasks/{ids[1]}").json()["status"] == "queued"
