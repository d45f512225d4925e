"""Admission over real HTTP: exact limits, Retry-After, pressure, tenants, keys, aging,
and the client's retries."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from conftest import WorkerFactory, make_settings, submit
from support.catalog import publish_builtin_catalog, tenant

from dispatcher.client import Client, Overloaded
from dispatcher.contract import keys
from dispatcher.contract.settings import ClassConfig, TenantConfig
from testkit import ApiServer, wait_for

KEYS = {"acme": "acme-secret-key", "globex": "globex-secret-key", "ops": "ops-admin-key"}


def _tenant(name: str, **limits: Any) -> TenantConfig:
    return tenant(name, KEYS[name], **limits)


def _auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


def _fake_workers(r: redis.Redis, count: int, run_s: float, cls: str = "batch") -> None:
    """Live workers and a known run time, so the drain rate is count / run_s."""
    for i in range(count):
        r.zadd(keys.WORKERS, {f"fake-{i}": int(time.time() * 1000) + 10**9})
        r.hset(keys.worker(f"fake-{i}"), mapping={"classes": f'["{cls}"]', "state": "idle"})
    r.hset(keys.stats(cls), mapping={"sum": run_s, "weight": 1, "at_ms": int(time.time() * 1000)})


@pytest.fixture
def api_with(
    redis_url: str, r: redis.Redis, api_factory: Callable[..., ApiServer]
) -> Callable[..., httpx.Client]:
    """An API with given settings and the built-in task types known."""
    publish_builtin_catalog(r)
    clients: list[httpx.Client] = []

    def start(**overrides: Any) -> httpx.Client:
        api = api_factory(make_settings(redis_url, **overrides))
        client = httpx.Client(base_url=api.url, timeout=10)
        clients.append(client)
        return client

    yield start
    for client in clients:
        client.close()


def test_exact_limit_under_concurrency(api_with: Callable[..., httpx.Client]) -> None:
    http = api_with(classes={"interactive": ClassConfig(), "batch": ClassConfig(max_queued=50)})

    async def flood() -> list[int]:
        async with httpx.AsyncClient(base_url=str(http.base_url), timeout=30) as client:
            replies = await asyncio.gather(
                *(client.post("/tasks", json={"type": "echo"}) for _ in range(200))
            )
        return [reply.status_code for reply in replies]

    codes = asyncio.run(flood())
    assert codes.count(202) == 50 and codes.count(503) == 150
    assert http.get("/queues").json()["classes"][1]["depth"] == 50


def test_retry_after_follows_the_drain_rate(
    api_with: Callable[..., httpx.Client], r: redis.Redis
) -> None:
    http = api_with(classes={"interactive": ClassConfig(), "batch": ClassConfig(max_wait_s=10)})
    _fake_workers(r, count=2, run_s=4.0)  # drains 0.5 task/s
    wait_for(lambda: http.get("/queues").json()["classes"][1]["workers"] == 2, 5, what="workers")
    # A new task waits (ahead + 1) * 4 / 2 s: accepted up to 4 ahead (10 s), refused at 5.
    accepted = [http.post("/tasks", json={"type": "echo"}) for _ in range(5)]
    assert [a.status_code for a in accepted] == [202] * 5
    assert [a.json()["estimated_wait_s"] for a in accepted] == [2.0, 4.0, 6.0, 8.0, 10.0]
    refused = http.post("/tasks", json={"type": "echo"})
    assert refused.status_code == 503 and refused.json()["error"] == "queue_full"
    assert refused.headers["retry-after"] == "2"  # 1 task too many at 0.5/s
    r.rpush(keys.queue("batch"), *[f"filler-{i}" for i in range(9)])  # 10 too many
    refused = http.post("/tasks", json={"type": "echo"})
    assert refused.headers["retry-after"] == "20" and refused.json()["retry_after_s"] == 20


def test_pressure_levels(api_with: Callable[..., httpx.Client]) -> None:
    http = api_with(classes={"interactive": ClassConfig(), "batch": ClassConfig(max_queued=4)})
    seen = []
    for _ in range(5):
        reply = http.post("/tasks", json={"type": "echo"})
        seen.append((reply.status_code, reply.headers["gpulane-pressure"],
                     reply.headers["gpulane-queue-depth"]))  # fmt: skip
    assert seen == [(202, "ok", "1"), (202, "high", "2"), (202, "high", "3"),
                    (202, "full", "4"), (503, "full", "4")]  # fmt: skip
    assert http.get("/queues").json()["classes"][1]["pressure"] == "full"


def test_no_workers_policy_per_class(api_with: Callable[..., httpx.Client]) -> None:
    http = api_with()
    refused = http.post("/tasks", json={"type": "echo", "class": "interactive"})
    assert refused.status_code == 503 and refused.json()["error"] == "no_workers"
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.headers["gpulane-estimated-wait"] == "-1"
    queued = http.post("/tasks", json={"type": "echo", "class": "batch"})
    assert queued.status_code == 202 and queued.json()["estimated_wait_s"] is None


def test_rate_limit_429_with_ratelimit_fields(api_with: Callable[..., httpx.Client]) -> None:
    http = api_with(tenants=[_tenant("acme", rate=1, burst=2)])
    ok = [http.post("/tasks", json={"type": "echo"}, headers=_auth("acme")) for _ in range(2)]
    assert [o.status_code for o in ok] == [202, 202]
    assert ok[0].headers["ratelimit-policy"] == '"tenant";q=2;w=2'
    assert ok[1].headers["ratelimit"].startswith('"tenant";r=0;')
    limited = http.post("/tasks", json={"type": "echo"}, headers=_auth("acme"))
    assert limited.status_code == 429 and limited.json()["error"] == "rate_limited"
    assert limited.headers["retry-after"] == "1"
    assert limited.headers["ratelimit-policy"] == '"tenant";q=2;w=2'
    assert limited.headers["ratelimit"].startswith('"tenant";r=0;t=')
    for header in ("gpulane-queue-depth", "gpulane-estimated-wait", "gpulane-pressure"):
        assert header in limited.headers


def test_max_in_flight(api_with: Callable[..., httpx.Client]) -> None:
    http = api_with(tenants=[_tenant("acme", max_in_flight=2)])
    first, _ = (http.post("/tasks", json={"type": "echo"}, headers=_auth("acme")) for _ in range(2))
    over = http.post("/tasks", json={"type": "echo"}, headers=_auth("acme"))
    assert over.status_code == 429 and "max_in_flight" in over.json()["message"]
    assert http.delete(f"/tasks/{first.json()['id']}", headers=_auth("acme")).status_code == 200
    assert http.post("/tasks", json={"type": "echo"}, headers=_auth("acme")).status_code == 202


def test_tenant_isolation(api_with: Callable[..., httpx.Client]) -> None:
    http = api_with(tenants=[_tenant("acme"), _tenant("globex"), _tenant("ops", admin=True)])
    task = http.post("/tasks", json={"type": "echo"}, headers=_auth("acme")).json()
    path = f"/tasks/{task['id']}"
    assert http.get(path, headers=_auth("globex")).status_code == 404
    assert http.delete(path, headers=_auth("globex")).status_code == 404
    assert http.get(path, headers=_auth("acme")).json()["status"] == "queued"
    assert http.get(path, headers=_auth("ops")).status_code == 200  # admins see all
    assert http.get("/workers", headers=_auth("acme")).status_code == 404
    assert http.get("/workers", headers=_auth("ops")).status_code == 200
    assert http.delete(path, headers=_auth("acme")).status_code == 200


def test_tenant_classes(api_with: Callable[..., httpx.Client]) -> None:
    http = api_with(tenants=[_tenant("acme", classes=["batch"])])
    refused = http.post(
        "/tasks", json={"type": "echo", "class": "interactive"}, headers=_auth("acme")
    )
    assert refused.status_code == 422 and refused.json()["known"] == ["batch"]
    assert [c["name"] for c in http.get("/queues", headers=_auth("acme")).json()["classes"]] == [
        "batch"
    ]


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer wrong-key", "Basic YWNtZTpzZWNyZXQ=", "Bearer", "Bearer " + "x" * 1000],
)
def test_bad_and_missing_keys(
    api_with: Callable[..., httpx.Client], authorization: str | None
) -> None:
    http = api_with(tenants=[_tenant("acme")])
    headers = {"Authorization": authorization} if authorization else {}
    for method, path in (("POST", "/tasks"), ("GET", "/tasks/x"), ("GET", "/queues")):
        reply = http.request(method, path, json={"type": "echo"}, headers=headers)
        assert reply.status_code == 401 and reply.json()["error"] == "unauthorized"
        assert reply.headers["www-authenticate"].startswith("Bearer")


def test_revoked_key(api_with: Callable[..., httpx.Client]) -> None:
    before = api_with(tenants=[_tenant("acme"), _tenant("globex")])
    assert before.get("/queues", headers=_auth("globex")).status_code == 200
    after = api_with(tenants=[_tenant("acme")])  # globex's key removed from the settings
    assert after.get("/queues", headers=_auth("globex")).status_code == 401
    assert after.get("/queues", headers=_auth("acme")).status_code == 200


def test_open_mode_warns(
    api_with: Callable[..., httpx.Client], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="gpulane.api"):
        http = api_with()
    assert any("no API keys configured" in r.getMessage() for r in caplog.records)
    assert http.get("/workers").status_code == 200  # open mode: tenant default, admin


def test_batch_ages_past_newer_interactive(
    api_with: Callable[..., httpx.Client], start_worker: WorkerFactory, tmp_path: Path
) -> None:
    aging = {"interactive": ClassConfig(), "batch": ClassConfig(promote_after_s=0.3)}
    http = api_with(classes=aging)  # interactive queues without workers here
    order = tmp_path / "order"

    def record(tag: str, cls: str) -> dict[str, Any]:
        return submit(http, "test.record", {"path": str(order), "tag": tag}, cls=cls)

    record("batch", "batch")
    wait_for(
        lambda: (http.get("/queues").json()["classes"][1]["oldest_wait_s"] or 0) > 0.3,
        10,
        what="the batch task to wait past its promotion age",
    )
    record("i0", "interactive")
    record("i1", "interactive")
    # Aging is applied by the worker's claim: it needs the same class settings.
    start_worker(env={"GPULANE_CLASSES": '{"interactive": {}, "batch": {"promote_after_s": 0.3}}'})
    wait_for(lambda: order.exists() and len(order.read_text().split()) == 3, 15, what="3 runs")
    assert order.read_text().split() == ["batch", "i0", "i1"]


class Recording(httpx.HTTPTransport):
    def __init__(self) -> None:
        super().__init__()
        self.codes: list[int] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        self.codes.append(response.status_code)
        return response


def test_client_retries_429(api_with: Callable[..., httpx.Client]) -> None:
    # A token every 2 s: the second submit finds the bucket empty even on a loaded
    # machine (at rate 2 a half-second stall between the submits refilled it).
    http = api_with(tenants=[_tenant("acme", rate=0.5, burst=1)])
    transport = Recording()
    with Client(str(http.base_url), KEYS["acme"], transport=transport) as client:
        first = client.submit("echo", {"n": 1})
        second = client.submit("echo", {"n": 2})  # the bucket is empty: 429, wait, retry
    assert first["status"] == second["status"] == "queued"
    assert transport.codes == [202, 429, 202]


def test_client_gives_up_with_a_typed_error(api_with: Callable[..., httpx.Client]) -> None:
    http = api_with(tenants=[_tenant("acme", rate=0.1, burst=1)])
    with Client(str(http.base_url), KEYS["acme"], max_retries=1, max_delay_s=0.05) as client:
        client.submit("echo")
        with pytest.raises(Overloaded) as refused:
            client.submit("echo")
    assert refused.value.code == "rate_limited" and refused.value.status == 429
    assert refused.value.retry_after_s is not None and refused.value.retry_after_s >= 1


def test_client_retries_503_until_the_queue_drains(api_with: Callable[..., httpx.Client]) -> None:
    http = api_with(classes={"interactive": ClassConfig(), "batch": ClassConfig(max_queued=1)})
    blocker = http.post("/tasks", json={"type": "echo"}).json()
    transport = Recording()

    def drain_after_refusal() -> None:
        wait_for(lambda: 503 in transport.codes, 10, what="a 503")
        http.delete(f"/tasks/{blocker['id']}")

    helper = threading.Thread(target=drain_after_refusal)
    helper.start()
    with Client(str(http.base_url), transport=transport, max_delay_s=0.5) as client:
        task = client.submit("echo")
    helper.join()
    assert task["status"] == "queued" and transport.codes[0] == 503 and transport.codes[-1] == 202
