"""GPU-aware health in real worker processes on fake GPUs: a fatal CUDA error hands
the task back and takes the worker out (exit 71), counting against the task's attempt
budget; a CUDA out-of-memory fails only that task; a lost or hung device is noticed by
the heartbeat while the process is alive."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import redis
from conftest import WorkerFactory, submit, wait_status

from dispatcher.contract import keys
from dispatcher.contract.exits import EXIT_UNHEALTHY
from testkit import fake_gpu_env, wait_for

GPU = ["--gpu", "auto"]
LONG_LEASE = {"lease_ttl_s": 3.0}  # an unhealthy worker stays listed for one lease


def _history(r: redis.Redis, task_id: str) -> list[dict[str, Any]]:
    raw = r.hget(keys.job(task_id), "history")
    return json.loads(raw) if raw else []


def _state(r: redis.Redis, name: str) -> str | None:
    raw = r.hget(keys.worker(name), "state")
    return raw.decode() if raw else None


def test_fatal_cuda_error_hands_the_task_to_another_worker(
    http: httpx.Client, r: redis.Redis, start_worker: WorkerFactory
) -> None:
    env = fake_gpu_env(2)
    first = start_worker("fault-a", extra=GPU, env=env, **LONG_LEASE)
    task = submit(http, "test.cuda_fault", {"until_attempt": 1})
    assert first.process.wait(20) == EXIT_UNHEALTHY, first.output()
    output = first.output()
    assert "fatal GPU error" in output and "worker unhealthy: Fatal GPU error" in output
    assert "task handed back after a GPU fault: requeued" in output
    # Listed as unhealthy, with why, for one lease after it left; not capacity.
    assert _state(r, first.name) == "unhealthy"
    reason = (r.hget(keys.worker(first.name), "reason") or b"").decode()
    assert "illegal memory access" in reason
    assert r.hget(keys.job(task["id"]), "status") == b"queued"
    [entry] = _history(r, task["id"])
    assert entry["outcome"] == "gpu_fault" and entry["worker"] == first.name
    assert "AcceleratorError: CUDA error: an illegal memory access" in entry["message"]
    assert _claims_of(r, first.name) == []  # its card was released for the next worker

    second = start_worker("fault-b", extra=GPU, env=env)
    record = wait_status(http, task["id"], {"succeeded"})
    assert record["worker"] == second.name and record["attempts"] == 2
    assert record["result"]["attempt"] == 2
    assert second.alive()


def _claims_of(r: redis.Redis, name: str) -> list[str]:
    return [k.decode() for k in r.scan_iter(keys.gpu_claim("*", "*")) if r.get(k) == name.encode()]


def test_a_task_that_breaks_every_gpu_fails_after_its_attempt_budget(
    http: httpx.Client, r: redis.Redis, start_worker: WorkerFactory
) -> None:
    env = fake_gpu_env(2)
    workers = [start_worker(f"poison{i}", extra=GPU, env=env, max_attempts=2) for i in range(2)]
    task = submit(http, "test.cuda_fault", {"until_attempt": 99})
    record = wait_status(http, task["id"], {"failed"}, timeout_s=30)
    assert record["error"]["code"] == "gpu_fault"
    assert "illegal memory access" in record["error"]["message"]
    assert [e["outcome"] for e in _history(r, task["id"])] == ["gpu_fault", "gpu_fault"]
    for proc in workers:  # each fault took one worker out; the supervisor restarts them
        assert proc.process.wait(20) == EXIT_UNHEALTHY


def test_out_of_memory_fails_only_that_task(
    http: httpx.Client, start_worker: WorkerFactory
) -> None:
    worker = start_worker(extra=GPU, env=fake_gpu_env(1))
    oom = submit(http, "test.cuda_fault", {"kind": "oom"})
    record = wait_status(http, oom["id"], {"failed"})
    assert record["error"]["code"] == "gpu_out_of_memory"
    assert "CUDA out of memory. Tried to allocate 20.00 GiB" in record["error"]["message"]
    assert record["attempts"] == 1
    stats = wait_status(http, submit(http, "test.torch_stats")["id"], {"succeeded"})
    assert stats["result"] == {"empty_cache_calls": 1}  # cached memory was freed
    assert stats["worker"] == worker.name and worker.alive()

    def counted() -> dict[str, Any] | None:
        listed = {w["name"]: w for w in http.get("/workers").json()["workers"]}
        entry = listed.get(worker.name)
        # Counts are published on heartbeats: wait for both, not one then the other.
        done = entry and entry["tasks_failed"] == 1 and entry["tasks_done"] == 1
        return entry if done else None

    entry = wait_for(counted, 5, what="the failure and the success to be counted")
    assert entry["state"] in ("idle", "busy")


def test_lost_device_while_a_task_runs(
    http: httpx.Client, r: redis.Redis, start_worker: WorkerFactory, tmp_path: Path
) -> None:
    env = fake_gpu_env(2, switches=tmp_path)
    worker = start_worker("lost", extra=GPU, env=env, **LONG_LEASE)
    task = submit(http, "sleep", {"seconds": 2.0})
    running = wait_status(http, task["id"], {"running"})
    index = running["device"]["index"]
    (tmp_path / f"lost-{index}").touch()  # NVML now answers GPU_IS_LOST for that card

    assert worker.process.wait(20) == EXIT_UNHEALTHY, worker.output()
    assert "worker unhealthy" in worker.output() and "is lost" in worker.output()
    assert _state(r, worker.name) == "unhealthy"
    [entry] = _history(r, task["id"])
    assert entry["outcome"] == "gpu_fault" and "is lost" in entry["message"]

    # A replacement leaves the lost card out and runs the task on the other one.
    replacement = start_worker("replacement", extra=GPU, env=env)
    record = wait_status(http, task["id"], {"succeeded"}, timeout_s=20)
    assert record["worker"] == replacement.name
    assert record["device"]["index"] == 1 - index and record["attempts"] == 2


def test_hung_device_is_noticed_while_idle(
    http: httpx.Client, r: redis.Redis, start_worker: WorkerFactory, tmp_path: Path
) -> None:
    env = fake_gpu_env(1, switches=tmp_path)
    worker = start_worker("hung", extra=GPU, env=env, gpu_sample_timeout_s=0.5, **LONG_LEASE)
    (tmp_path / "hang-0").touch()  # NVML calls on the card block from now on
    try:
        assert worker.process.wait(20) == EXIT_UNHEALTHY, worker.output()
    finally:
        (tmp_path / "hang-0").unlink()
    assert "stopped answering" in worker.output()
    assert _state(r, worker.name) == "unhealthy"
    assert _claims_of(r, worker.name) == []
