"""`docker compose up --scale worker=4` on a real Docker Engine: the product's own
deployment line, run as the README gives it (compose.yaml with the CPU overlay).

The engine, the Compose v2 plugin and the base images the files name come from
scripts/ensure-docker.sh (`make test-slow` runs it). No registry is reachable from
these machines, so the project's image is built here offline: a wheelhouse made on the
host (tests/support/containers.py) and the Dockerfile's no-index branch. Each worker is a
container of its own, a host with its own name and address on the stack's network.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from support.containers import Stack, build_image, require_engine

from testkit import free_port, wait_for

pytestmark = pytest.mark.slow

WORKERS = 4


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    require_engine()
    build_image()
    stack = Stack(project="gpulane-ct", port=free_port())
    stack.down()  # what an interrupted run left behind
    stack.up(WORKERS)
    try:
        stack.wait_serving(WORKERS)
        yield stack
    finally:
        stack.save_logs()
        stack.down()


def _submit(http: httpx.Client, seconds: float) -> str:
    response = http.post("/tasks", json={"type": "sleep", "args": {"seconds": seconds}})
    assert response.status_code == 202, response.text
    task_id: str = response.json()["id"]
    return task_id


def _final(stack: Stack, ids: list[str], timeout_s: float = 60) -> list[dict[str, Any]]:
    """The records of ``ids`` once every one is final, read through the API."""

    def check() -> list[dict[str, Any]] | None:
        records = [stack.record(task_id) for task_id in ids]
        done = all(
            r is not None and r["status"] in {"succeeded", "failed", "canceled"} for r in records
        )
        return [r for r in records if r is not None] if done else None

    records: list[dict[str, Any]] = wait_for(check, timeout_s, what=f"{len(ids)} tasks final")
    return records


def test_the_image_runs_as_a_non_root_user(stack: Stack) -> None:
    for container in [stack.container("api"), *stack.containers("worker")]:
        assert stack.exec(container, "id", "-u") == "1000", container


def test_four_workers_on_four_hosts_share_the_tasks(stack: Stack) -> None:
    workers = stack.http.get("/workers").json()["workers"]
    hosts = {w["host"] for w in workers}
    assert len(workers) == WORKERS and len(hosts) == WORKERS
    assert hosts == {stack.hostname(c) for c in stack.containers("worker")}
    # Tasks of one second each: every idle worker claims one the moment it is queued.
    ids = [_submit(stack.http, 1.0) for _ in range(3 * WORKERS)]
    records = _final(stack, ids)
    assert [r["status"] for r in records] == ["succeeded"] * len(ids)
    served = {r["worker"].rsplit(".", 1)[0] for r in records}
    assert served == hosts, served


def test_a_worker_container_killed_mid_task_loses_nothing(stack: Stack) -> None:
    task_id = _submit(stack.http, 4.0)
    running = wait_for(
        lambda: (r := stack.record(task_id)) is not None and r["status"] == "running" and r,
        30,
        what="the task running",
    )
    host = running["worker"].rsplit(".", 1)[0]
    victim = next(c for c in stack.containers("worker") if stack.hostname(c) == host)
    stack.docker("kill", "--signal", "KILL", victim)
    # The lease runs out, the reaper puts the task back, another worker runs it whole.
    [record] = _final(stack, [task_id])
    assert record["status"] == "succeeded", record
    assert record["attempts"] == 2 and not record["worker"].startswith(host), record
    stack.up(WORKERS)  # the scale back to four, whatever the restart policy did
    stack.wait_serving(WORKERS)


def test_an_api_container_restart_loses_nothing(stack: Stack) -> None:
    ids = [_submit(stack.http, 0.5) for _ in range(2 * WORKERS)]
    stack.compose("restart", "api")
    stack.wait_api()
    ids.append(_submit(stack.http, 0.1))  # and it takes new work
    records = _final(stack, ids)
    assert [r["status"] for r in records] == ["succeeded"] * len(ids)


def test_down_v_leaves_nothing_running(stack: Stack) -> None:
    assert stack.resources()["containers"]  # the stack is up before
    stack.down()
    left = stack.resources()
    assert left == {"containers": [], "volumes": [], "networks": []}, left
    with pytest.raises(httpx.TransportError):  # the published port is gone with the API
        stack.http.get("/health", timeout=5)
