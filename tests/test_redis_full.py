"""Redis at ``maxmemory`` with ``noeviction``: writes are refused whole and answered
``503 store_unavailable``, reads go on, workers wait with their leases, and everything
resumes once memory frees. A real redis-server of its own, a real ``maxmemory``."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from typing import Any

import httpx
from conftest import WorkerFactory, make_settings, wait_status
from support.catalog import publish_builtin_catalog

from dispatcher.contract import keys
from testkit import ApiServer, RedisServer, wait_for

FILE_BYTES = 300_000


def _fill(http: httpx.Client, limit: int = 40) -> tuple[list[str], httpx.Response]:
    """Queue uploads on batch (no worker serves it) until Redis refuses one."""
    accepted: list[str] = []
    for _ in range(limit):
        upload = {"file": ("a.pdf", os.urandom(FILE_BYTES), "application/pdf")}
        response = http.post("/tasks", files=upload, data={"class": "batch"})
        if response.status_code != 202:
            return accepted, response
        accepted.append(response.json()["id"])
    raise AssertionError(f"redis never filled up after {limit} tasks")


def _worker(http: httpx.Client, name: str) -> dict[str, Any] | None:
    found = [w for w in http.get("/workers").json()["workers"] if w["name"] == name]
    return found[0] if found else None


def test_full_redis_refuses_writes_serves_reads_and_recovers(
    private_redis: RedisServer,
    api_factory: Callable[..., ApiServer],
    start_worker: WorkerFactory,
) -> None:
    client = private_redis.client()
    publish_builtin_catalog(client)
    api = api_factory(make_settings(private_redis.url))
    tenant = {"name": "t", "key_sha256": hashlib.sha256(b"key-t").hexdigest(), "admin": True}
    keyed = api_factory(make_settings(private_redis.url, tenants=[tenant]))
    worker = start_worker("full-w", classes="interactive", redis_url_override=private_redis.url)
    with httpx.Client(base_url=api.url, timeout=10) as http:
        # A task that ends while Redis is full: its report must wait, not be lost.
        slow = http.post(
            "/tasks", json={"type": "sleep", "class": "interactive", "args": {"seconds": 1}}
        )
        assert slow.status_code == 202
        wait_status(http, slow.json()["id"], {"running"})
        used = int(client.info("memory")["used_memory"])
        client.config_set("maxmemory", used + 2_000_000)
        accepted, refused = _fill(http)
        assert len(accepted) >= 2
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"] == "store_unavailable"
        assert "full" in refused.json()["message"]
        assert int(refused.headers["Retry-After"]) >= 1

        # Small writes may still fit (and Redis shrinks idle buffers): hold it well
        # over its limit for the rest.
        over = int(client.info("memory")["used_memory"]) // 2
        client.config_set("maxmemory", over)

        # Nothing half-written: exactly the accepted tasks exist and are queued.
        assert client.llen(keys.queue("batch")) == len(accepted)
        assert len(list(client.scan_iter(keys.job("*")))) == len(accepted) + 1  # + slow
        held = int(client.get(keys.queued_bytes("batch")) or 0)
        assert held == len(accepted) * FILE_BYTES

        # Reads keep working; /health tells.
        for task_id in accepted:
            record = http.get(f"/tasks/{task_id}")
            assert record.status_code == 200, record.text
            assert record.json()["status"] == "queued"
        for path in ("/queues", "/stats", "/workers", "/metrics"):
            assert http.get(path).status_code == 200, path
        # With keys, the rate limit still takes its token (allow-oom): reads work.
        auth = {"Authorization": "Bearer key-t"}
        for path in ("/queues", f"/tasks/{accepted[-1]}"):
            assert httpx.get(keyed.url + path, headers=auth).status_code == 200, path
        health = http.get("/health")
        assert health.status_code == 200
        assert health.json()["redis"] == "full"
        assert health.json()["status"] == "degraded"
        assert health.json()["memory"]["max_bytes"] == over
        # Writes refused: a cancel too, and it leaves the task as it was.
        cancel = http.delete(f"/tasks/{accepted[0]}")
        assert cancel.status_code == 503
        assert http.get(f"/tasks/{accepted[0]}").json()["status"] == "queued"

        # The worker's report is refused; then, idle, its claims are (it tries every
        # 5 s). It stays up, says why, and keeps its lease (1 s) meanwhile.
        wait_for(
            lambda: "holding" in ((_worker(http, "full-w") or {}).get("reason") or ""),
            10,
            what="the worker to say it holds an outcome",
        )
        assert http.get(f"/tasks/{slow.json()['id']}").json()["status"] == "running"
        assert worker.alive(), worker.output()

        # Memory frees: the held outcome is reported.
        client.config_set("maxmemory", 0)
        wait_status(http, slow.json()["id"], {"succeeded"}, 15)

        # Full again with the worker idle: its claims are refused (it looks every 5 s);
        # it stays up and says so, with its lease kept (1 s).
        client.config_set("maxmemory", over)
        wait_for(
            lambda: "takes no task" in ((_worker(http, "full-w") or {}).get("reason") or ""),
            20,
            what="the idle worker to say redis is full",
        )
        assert worker.alive(), worker.output()

        # Memory frees: everything resumes by itself.
        client.config_set("maxmemory", 0)
        assert http.get("/health").json()["redis"] == "ok"
        task = http.post("/tasks", json={"type": "echo", "class": "interactive", "args": {"x": 1}})
        assert task.status_code == 202, task.text
        done = wait_status(http, task.json()["id"], {"succeeded", "failed"}, 20)
        assert done["status"] == "succeeded"
        assert http.get(f"/tasks/{slow.json()['id']}").json()["status"] == "succeeded"
        wait_for(
            lambda: (_worker(http, "full-w") or {"reason": "gone"}).get("reason") is None,
            5,
            what="the worker's reason to clear",
        )
        assert http.delete(f"/tasks/{accepted[0]}").status_code == 200
        assert int(client.get(keys.queued_bytes("batch")) or 0) < held
        assert worker.alive()
    assert "Traceback" not in worker.output()
    client.close()
