"""Fair share by device time and device-time usage with real processes: the real API
over HTTP, real worker processes, the real Redis. Tenants of 10 ms and 500 ms tasks
split two saturated workers' device time by their weights; a lone tenant uses the
whole pool and the usage read adds up to the time the workers were busy; a device
quota refuses with Retry-After. (The scripts alone: tests/test_device_time_scripts.py.)

Shares are read from GET /usage, what the workers measured, while both tenants still
have work queued: the waits are on the usage reaching a total, never on a clock."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import redis
from conftest import WorkerFactory, make_settings
from support.catalog import tenant
from support.observe import dashboard

from dispatcher.contract import keys
from dispatcher.contract.settings import TenantConfig
from testkit import TEST_TASKS, ApiServer, publish_catalog, wait_for

TASKS = f"worker.tasks.builtin,{TEST_TASKS},gl_fair_tasks"
SMALL_S, LARGE_S = 0.01, 0.5
ApiFactory = Callable[[Any], ApiServer]
Clients = dict[str, httpx.Client]


def _tenant(name: str, **limits: Any) -> TenantConfig:
    limits = {"rate": 10_000, "burst": 10_000, "max_in_flight": 10_000, **limits}
    return tenant(name, f"{name}-secret-key", **limits)


@pytest.fixture
def clients(
    r: redis.Redis, redis_url: str, api_factory: ApiFactory
) -> Iterator[Callable[..., Clients]]:
    """An API with these tenants and an admin: an HTTP client per tenant, by name."""
    publish_catalog(r, TEST_TASKS, "gl_fair_tasks")
    opened: list[httpx.Client] = []

    def start(*configured: TenantConfig) -> Clients:
        everyone = [*configured, _tenant("ops", admin=True)]
        api = api_factory(make_settings(redis_url, tenants=everyone))
        for t in everyone:
            headers = {"Authorization": f"Bearer {t.name}-secret-key"}
            opened.append(httpx.Client(base_url=api.url, headers=headers, timeout=30))
        return {
            t.name: client for t, client in zip(everyone, opened[-len(everyone) :], strict=True)
        }

    yield start
    for client in opened:
        client.close()


def _bulk(client: httpx.Client, task_type: str, seconds: float, n: int) -> None:
    tasks = [{"type": task_type, "args": {"seconds": seconds}} for _ in range(n)]
    reply = client.post("/tasks", json=tasks)
    assert reply.status_code == 202, reply.text


def _usage(ops: httpx.Client) -> dict[str, Any]:
    reply = ops.get("/usage")
    assert reply.status_code == 200, reply.text
    body: dict[str, Any] = reply.json()
    return body


def _split_when(ops: httpx.Client, total_s: float) -> dict[str, float]:
    """Each tenant's device seconds once the pool has used ``total_s`` in all."""
    body = wait_for(
        lambda: (u := _usage(ops))["device_seconds"] >= total_s and u,
        total_s + 60,
        what=f"{total_s} device-seconds used",
        interval_s=0.1,
    )
    return {t: s for t, s in body["tenants"].items()}


def _both_queued(r: redis.Redis, *names: str) -> bool:
    return all(r.llen(keys.lane("batch", name)) > 0 for name in names)


def test_equal_weights_split_device_time_between_small_and_large_tasks(
    r: redis.Redis, clients: Callable[..., Clients], start_worker: WorkerFactory
) -> None:
    http = clients(_tenant("small"), _tenant("large"))
    _bulk(http["small"], "test.small", SMALL_S, 1_800)  # 18 s of work
    _bulk(http["large"], "test.large", LARGE_S, 36)  # 18 s of work
    for n in range(2):
        start_worker(f"dt-even-{n}", extra=["--tasks", TASKS])
    split = _split_when(http["ops"], 24.0)
    assert _both_queued(r, "small", "large")  # the split was taken under contention
    ratio = split["small"] / split["large"]
    # Count-based fair share would give them about 1 : 50 here.
    assert 0.85 <= ratio <= 1.15, split


def test_weights_3_to_1_split_device_time_3_to_1(
    r: redis.Redis, clients: Callable[..., Clients], start_worker: WorkerFactory
) -> None:
    http = clients(_tenant("small", weight=3), _tenant("large", weight=1))
    _bulk(http["small"], "test.small", SMALL_S, 2_000)
    _bulk(http["large"], "test.large", LARGE_S, 24)
    for n in range(2):
        start_worker(f"dt-weights-{n}", extra=["--tasks", TASKS])
    split = _split_when(http["ops"], 20.0)
    assert _both_queued(r, "small", "large")
    ratio = split["small"] / split["large"]
    assert 3 * 0.85 <= ratio <= 3 * 1.15, split


def test_a_lone_tenant_uses_the_whole_pool_and_usage_adds_up(
    r: redis.Redis, clients: Callable[..., Clients], start_worker: WorkerFactory
) -> None:
    http = clients(_tenant("solo"))
    n = 16
    reply = http["solo"].post(
        "/tasks", json=[{"type": "test.large", "args": {"seconds": LARGE_S}}] * n
    )
    ids = reply.json()["ids"]
    for k in range(2):
        start_worker(f"dt-solo-{k}", extra=["--tasks", TASKS])

    def ended() -> list[list[bytes | None]] | None:
        rows = [
            r.hmget(keys.job(i), "status", "started_ms", "ended_ms", "worker_name") for i in ids
        ]
        return rows if all(row[0] == b"finished" for row in rows) else None

    rows = wait_for(ended, 60, what="every task finished", interval_s=0.1)
    busy_s = sum(int(row[2] or 0) - int(row[1] or 0) for row in rows) / 1000
    per_worker = [sum(1 for row in rows if row[3] == w) for w in {row[3] for row in rows}]
    assert len(per_worker) == 2 and min(per_worker) >= n // 2 - 2  # both workers served it
    # The usage read: what the workers measured, once their last beats are in.
    body = wait_for(
        lambda: (u := _usage(http["ops"]))["device_seconds"] >= 0.98 * busy_s and u,
        10,
        what="the usage to add up",
    )
    assert body["device_seconds"] <= 1.02 * busy_s, (body, busy_s)
    assert body["tenants"] == {"solo": body["device_seconds"]}
    assert [(u["tenant"], u["class"], u["type"]) for u in body["usage"]] == [
        ("solo", "batch", "test.large")
    ]
    assert body["complete"] is False and body["resolution_s"] == 60
    # The same figure in /stats (the tenant sees its own) and in /metrics.
    stats = http["solo"].get("/stats").json()["device_seconds"]
    assert set(stats) == {"solo"}
    assert stats["solo"]["total"] == pytest.approx(body["device_seconds"], rel=1e-6)
    metrics = http["ops"].get("/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith("gpulane_device_seconds_total{"))
    assert 'tenant="solo"' in line and 'type="test.large"' in line
    assert float(line.rsplit(" ", 1)[1]) == pytest.approx(body["device_seconds"], rel=1e-6)
    # Only an admin reads usage; a bad time is a 422 naming it.
    assert http["solo"].get("/usage").status_code == 404
    bad = http["ops"].get("/usage", params={"since": "yesterday"})
    assert bad.status_code == 422 and bad.json()["field"] == "since"
    old = http["ops"].get("/usage", params={"since": "0"}).json()
    assert old["partial"] is True and old["since"] > "1970-01-02"  # from what is kept
    assert old["device_seconds"] == body["device_seconds"]


def test_a_device_quota_refuses_with_retry_after(
    r: redis.Redis, clients: Callable[..., Clients], start_worker: WorkerFactory
) -> None:
    http = clients(_tenant("capped", device_seconds_per_hour=1.0))
    start_worker("dt-quota", extra=["--tasks", TASKS])
    capped = http["capped"]
    for _ in range(2):
        reply = capped.post("/tasks", json={"type": "test.large", "args": {"seconds": 0.6}})
        assert reply.status_code == 202, reply.text
    wait_for(
        lambda: _usage(http["ops"])["tenants"].get("capped", 0) >= 1.0,
        30,
        what="the tenant's hour used",
    )
    refused = capped.post("/tasks", json={"type": "test.small", "args": {}})
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"] == "rate_limited"
    assert "device_seconds_per_hour" in refused.json()["message"]
    assert 3000 <= int(refused.headers["Retry-After"]) <= 3600
    # The others are not affected.
    ok = http["ops"].post("/tasks", json={"type": "test.small", "args": {}})
    assert ok.status_code == 202


def test_the_dashboard_shows_device_time(
    r: redis.Redis, redis_url: str, api_factory: ApiFactory, start_worker: WorkerFactory
) -> None:
    publish_catalog(r, TEST_TASKS, "gl_fair_tasks")
    api = api_factory(make_settings(redis_url))  # no keys: every caller is tenant "default"
    start_worker("dt-dash", extra=["--tasks", TASKS])
    with httpx.Client(base_url=api.url) as http:
        reply = http.post("/tasks", json={"type": "test.large", "args": {"seconds": 0.2}})
        assert reply.status_code == 202
        wait_for(
            lambda: (
                http.get("/stats").json()["device_seconds"].get("default", {}).get("total", 0)
                > 0.19
            ),
            15,
            what="the device time in /stats",
        )
    with dashboard(api.url) as page:
        page.wait_for_selector("#device-panel:not([hidden])", timeout=15_000)
        row = page.inner_text("#device-rows")
        assert "test.large" in row and "batch" in row and "100.0 %" in row, row


def test_a_batch_shares_its_time_by_what_its_items_report(
    r: redis.Redis, clients: Callable[..., Clients], start_worker: WorkerFactory
) -> None:
    # test.sized takes 200 ms a call and shares it by each item's `n` (as embed does by
    # tokens): 9 : 1 only when one call held both tenants' items and shared it by n
    # (equal shares, or a call each, would give 1 : 1).
    http = clients(_tenant("tiny"), _tenant("huge"))
    for name, n in (("tiny", 1), ("huge", 9)):
        reply = http[name].post("/tasks", json=[{"type": "test.sized", "args": {"n": n}}] * 2)
        assert reply.status_code == 202, reply.text
    start_worker("dt-sized", extra=["--tasks", TASKS])  # one call takes all four items
    split = wait_for(
        lambda: len((u := _usage(http["ops"]))["tenants"]) == 2 and u["tenants"],
        30,
        what="both tenants' usage",
    )
    assert split["huge"] / split["tiny"] == pytest.approx(9, rel=0.01), split
