"""``min_replica_acks``: POST /tasks answers 202 only once that many replicas hold the
task (Redis WAIT), else 503 store_unavailable; a resubmit with the same
Idempotency-Key then finds the task. Real master and replica redis-servers."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import redis
from conftest import WorkerFactory, make_settings, wait_status

from dispatcher.contract import keys
from dispatcher.contract.settings import Settings
from testkit import ApiServer, RedisServer, wait_for


@pytest.fixture
def replica(redis_server: RedisServer, tmp_path: Path) -> Iterator[Callable[[], RedisServer]]:
    started: list[RedisServer] = []

    def start() -> RedisServer:
        server = RedisServer(tmp_path / "replica", replicaof=f"127.0.0.1 {redis_server.port}")
        started.append(server.start())
        wait_for(
            lambda: server.client().info("replication").get("master_link_status") == "up",
            10,
            what="the replica to sync",
        )
        return server

    yield start
    for server in started:
        server.kill()
    redis_server.client().execute_command("REPLICAOF", "NO", "ONE")  # it stays a master


def _api(
    redis_url: str, api_factory: Callable[[Settings], ApiServer], ack_timeout_s: float = 5.0
) -> httpx.Client:
    """An API whose submits wait for one replica. With a replica attached the timeout is
    generous (a loaded machine may take a while to ack; the answer comes at the ack);
    the test without one waits it out, so it passes a shorter one."""
    settings = make_settings(redis_url, min_replica_acks=1, replica_ack_timeout_s=ack_timeout_s)
    return httpx.Client(base_url=api_factory(settings).url, timeout=10)


def test_submit_without_replica_acks_is_503_and_the_key_finds_it_later(
    known_types: None,
    redis_url: str,
    r: redis.Redis,
    api_factory: Callable[[Settings], ApiServer],
    replica: Callable[[], RedisServer],
) -> None:
    http = _api(redis_url, api_factory, ack_timeout_s=1.0)
    body = {"type": "echo", "args": {"n": 1}}
    headers = {"Idempotency-Key": "order-1"}
    refused = http.post("/tasks", json=body, headers=headers)
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"] == "store_unavailable"
    assert "Idempotency-Key" in refused.json()["message"]
    assert refused.headers["Retry-After"]
    # The master holds it (it was not confirmed, not rolled back): one task, no more.
    assert r.llen(keys.queue("batch")) == 1
    replica()
    replayed = http.post("/tasks", json=body, headers=headers)
    assert replayed.status_code == 200, replayed.text
    assert replayed.headers["Idempotent-Replayed"] == "true"
    assert r.llen(keys.queue("batch")) == 1


def test_submit_confirmed_by_a_replica_is_on_the_replica(
    known_types: None,
    redis_url: str,
    api_factory: Callable[[Settings], ApiServer],
    replica: Callable[[], RedisServer],
) -> None:
    copy = replica()
    http = _api(redis_url, api_factory)
    accepted = http.post("/tasks", json={"type": "echo", "args": {}})
    assert accepted.status_code == 202, accepted.text
    task_id = accepted.json()["id"]
    # WAIT returned 1: the replica had it before the answer left.
    assert copy.client().hget(keys.job(task_id), "status") == b"queued"


def test_workers_claim_and_report_through_replica_acks(
    redis_url: str,
    api_factory: Callable[[Settings], ApiServer],
    replica: Callable[[], RedisServer],
    start_worker: WorkerFactory,
) -> None:
    """Workers with min_replica_acks send each claim and report with a WAIT (one round
    trip); with a replica attached tasks flow as usual."""
    copy = replica()
    start_worker(min_replica_acks=1, replica_ack_timeout_s=5.0)
    http = _api(redis_url, api_factory)
    ids = [
        http.post("/tasks", json={"type": "echo", "args": {"i": i}}).json()["id"] for i in range(5)
    ]
    for task_id in ids:
        assert wait_status(http, task_id, {"succeeded"})["attempts"] == 1
        assert copy.client().hget(keys.job(task_id), "status") == b"finished"
