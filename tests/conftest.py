"""Fixtures: a real redis-server for the session (flushed per test), the real API over
HTTP, and real worker processes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from redis.connection import Connection
from support.catalog import publish_builtin_catalog

from dispatcher.contract import keys
from dispatcher.contract.settings import Settings
from testkit import (
    TEST_TASKS,
    ApiServer,
    RedisServer,
    WorkerProcess,
    publish_catalog,
    wait_for,
    worker_env,
)

# Fast liveness for tests; the defaults (1 s / 3 s) are for production.
FAST = {"heartbeat_interval_s": 0.2, "lease_ttl_s": 1.0}


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of the test's own (AOF, fsync always), for the tests that kill,
    restart or fill it: the session's server is shared and must stay up and empty."""
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.kill()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    redis_server.client().flushall()
    return redis_server.url


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def make_settings(redis_url: str, **overrides: Any) -> Settings:
    # Tests publish the catalog they need (`known_types`); the API's own publication at
    # start is tested on its own (tests/test_catalog_start.py).
    return Settings(redis_url=redis_url, **{**FAST, "catalog_on_start": False, **overrides})


MAXMEMORY = 512 * 1024 * 1024


@pytest.fixture
def maxmemory(r: redis.Redis) -> Iterator[int]:
    """The test Redis with a maxmemory (noeviction, as always), as deploy/k8s runs it:
    the memory series and alerts read it. Restored after the test, since the server is
    shared by the session. Yields the limit."""
    before = str(r.config_get("maxmemory")["maxmemory"])
    r.config_set("maxmemory", MAXMEMORY)
    yield MAXMEMORY
    r.config_set("maxmemory", before)


@pytest.fixture
def known_types(r: redis.Redis) -> None:
    """The built-in and test task types known with no worker running. Request it
    before `api`/`http`, which read the catalog at start."""
    publish_builtin_catalog(r)


@pytest.fixture
def known_embed(r: redis.Redis) -> None:
    """The embed type (the real model's task) in the catalog with no worker running, as
    a fresh deployment that configures it publishes it. Request it before `api`/`http`."""
    publish_catalog(r, "worker.tasks.embed")


@pytest.fixture
def settings(redis_url: str) -> Settings:
    return make_settings(redis_url)


@pytest.fixture
def api_factory() -> Iterator[Callable[[Settings], ApiServer]]:
    servers: list[ApiServer] = []

    def start(settings: Settings) -> ApiServer:
        server = ApiServer(settings).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def api(settings: Settings, api_factory: Callable[[Settings], ApiServer]) -> ApiServer:
    return api_factory(settings)


@pytest.fixture
def http(api: ApiServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=api.url, timeout=10) as client:
        yield client


WorkerFactory = Callable[..., WorkerProcess]


@pytest.fixture
def start_worker(redis_url: str, request: pytest.FixtureRequest) -> Iterator[WorkerFactory]:
    """Start `gpulane worker` processes; each call waits until the worker registered."""
    started: list[WorkerProcess] = []
    client = redis.Redis.from_url(redis_url)

    def start(
        name: str | None = None,
        *,
        classes: str | None = None,
        wait: bool = True,
        extra: list[str] | None = None,
        redis_url_override: str | None = None,
        env: dict[str, str] | None = None,
        **settings: Any,
    ) -> WorkerProcess:
        name = name or f"w{len(started)}-{request.node.name[:20]}"
        args = ["--gpu", "none", "--tasks", f"worker.tasks.builtin,{TEST_TASKS}"]
        if classes:
            args += ["--classes", classes]
        environment = {
            **worker_env(redis_url_override or redis_url, **{**FAST, **settings}),
            **(env or {}),
        }
        proc = WorkerProcess(name, environment, args + (extra or []))
        started.append(proc)
        if wait:
            # Serving: registered with its task types and past its first claim. (A worker
            # is listed earlier, while it loads or waits for a GPU.)
            watch = redis.Redis.from_url(redis_url_override) if redis_url_override else client
            wait_for(
                lambda: (
                    watch.hget(keys.worker(name), "state") in (b"idle", b"busy") or not proc.alive()
                ),
                20,
                what=f"worker {name} to serve",
            )
            assert proc.alive(), proc.output()
        return proc

    yield start
    for proc in started:
        proc.kill()
    client.close()


def wait_status(
    http: httpx.Client, task_id: str, statuses: set[str], timeout_s: float = 15
) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        record: dict[str, Any] = http.get(f"/tasks/{task_id}").json()
        return record if record.get("status") in statuses else None

    result: dict[str, Any] = wait_for(check, timeout_s, what=f"task {task_id} in {statuses}")
    return result


def submit(
    http: httpx.Client,
    task_type: str,
    args: dict[str, Any] | None = None,
    cls: str = "batch",
    **extra: Any,
) -> dict[str, Any]:
    response = http.post(
        "/tasks", json={"type": task_type, "class": cls, "args": args or {}, **extra}
    )
    assert response.status_code == 202, response.text
    body: dict[str, Any] = response.json()
    return body


@pytest.fixture
def round_trips(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every round trip to Redis from a synchronous client: one entry per packet of
    commands sent (a worker's scripts go as one), what was sent."""
    sent: list[bytes] = []
    send = Connection.send_packed_command

    def recorded(self: Connection, command: Any, check_health: bool = True) -> None:
        sent.append(command if isinstance(command, bytes) else b"".join(command))
        send(self, command, check_health)  # type: ignore[no-untyped-call]

    monkeypatch.setattr(Connection, "send_packed_command", recorded)
    return sent
