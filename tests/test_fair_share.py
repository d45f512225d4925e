"""Fair share among tenants with real processes: the real API over HTTP, real worker
processes, the real Redis. A small tenant is served next to another's backlog, weights
split a saturated pool, no tenants is FIFO, a killed worker's task goes back into its
lane, and a cancel takes a task out of its lane. (The Lua scripts alone:
tests/test_fair_scripts.py.)

These tests check the exact turns of count-based fair share (`fair_share_by =
"tasks"`: one turn per item), so their workers run in that mode; fair share by device
time, the default, is tested by tests/test_device_time.py.

Orders are never read off clocks: claims in the order Redis ran them come from the
claim notifications (support/claims.py), and tasks that hold their worker
(support/gl_fair_tasks.py) stop the pool at a known point instead of a sleep."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from conftest import WorkerFactory, make_settings, submit, wait_status
from rq import Queue
from support.catalog import tenant
from support.claims import ClaimLog

from dispatcher.contract import keys
from dispatcher.contract.settings import TenantConfig
from testkit import TEST_TASKS, ApiServer, publish_catalog, wait_for

TASKS = f"worker.tasks.builtin,{TEST_TASKS},gl_fair_tasks"
CLS = "batch"
ApiFactory = Callable[[Any], ApiServer]


def _key(name: str) -> str:
    return f"{name}-secret-key"


def _tenant(name: str, weight: float = 1.0) -> TenantConfig:
    # Limits far above what a test sends: fair order alone decides who runs next.
    return tenant(name, _key(name), weight=weight, rate=10_000, burst=10_000, max_in_flight=1_000)


@pytest.fixture
def catalog(r: redis.Redis) -> None:
    """Every task type the tests submit (test.gate too), known before any worker runs."""
    publish_catalog(r, TEST_TASKS, "gl_fair_tasks")


Tenants = Callable[..., dict[str | None, httpx.Client]]


@pytest.fixture
def tenants(redis_url: str, api_factory: ApiFactory) -> Iterator[Tenants]:
    """Start an API with these tenants (and settings): an HTTP client per tenant, by
    name, each with its bearer key, and an anonymous one under None."""
    opened: list[httpx.Client] = []

    def start(*configured: TenantConfig, **settings: Any) -> dict[str | None, httpx.Client]:
        api = api_factory(make_settings(redis_url, tenants=list(configured), **settings))
        out: dict[str | None, httpx.Client] = {}
        for name in [*(t.name for t in configured), None]:
            headers = {"Authorization": f"Bearer {_key(name)}"} if name else {}
            out[name] = httpx.Client(base_url=api.url, headers=headers, timeout=10)
            opened.append(out[name])
        return out

    yield start
    for client in opened:
        client.close()


@pytest.fixture
def claims(redis_url: str) -> Iterator[ClaimLog]:
    with ClaimLog(redis_url) as log:
        yield log


def _lane(r: redis.Redis, name: str) -> list[str]:
    return [i.decode() for i in r.lrange(keys.lane(CLS, name), 0, -1)]


def _queue(r: redis.Redis) -> list[str]:
    return [i.decode() for i in r.lrange(keys.queue(CLS), 0, -1)]


def _active(r: redis.Redis) -> set[str]:
    return {t.decode() for t in r.zrange(keys.lanes(CLS), 0, -1)}


def _assert_drained(r: redis.Redis, *tenants: str) -> None:
    """Nothing left queued: the class list, every lane and the active set are empty."""
    assert r.llen(keys.queue(CLS)) == 0
    assert r.zcard(keys.lanes(CLS)) == 0
    for name in tenants:
        assert not r.exists(keys.lane(CLS, name)), name


def test_a_small_tenant_is_served_next_to_a_backlog(
    r: redis.Redis,
    catalog: None,
    tenants: Tenants,
    start_worker: WorkerFactory,
    claims: ClaimLog,
    tmp_path: Path,
) -> None:
    http = tenants(_tenant("bulk"), _tenant("small"))
    bulk, small = http["bulk"], http["small"]
    hold = tmp_path / "hold"
    hold.touch()
    free = 20  # bulk's first tasks run; each later one holds its worker while `hold` exists
    bulk_ids = [
        submit(bulk, "test.gate", {"tag": f"b{n}", "seconds": 0.01, **held})["id"]
        for n, held in enumerate([{}] * free + [{"hold": str(hold)}] * (300 - free))
    ]
    assert r.llen(keys.queue(CLS)) == 300 and _lane(r, "bulk") == bulk_ids

    # Two workers work through the backlog until each holds one of bulk's tasks.
    workers = 2
    for n in range(workers):
        start_worker(f"fair-backlog-{n}", extra=["--tasks", TASKS], fair_share_by="tasks")
    held_log = Path(f"{hold}.held")
    wait_for(
        lambda: held_log.exists() and len(held_log.read_text().split()) == workers,
        30,
        what="both workers to hold a task",
    )
    before = claims.wait(free + workers)
    assert before == bulk_ids[: free + workers]  # a lone tenant: FIFO
    assert len(_lane(r, "bulk")) == 300 - free - workers

    # small arrives with the pool busy and hundreds of bulk's tasks queued.
    replies = [
        small.post("/tasks", json={"type": "test.gate", "args": {"tag": f"s{n}"}}) for n in range(5)
    ]
    assert [reply.status_code for reply in replies] == [202] * 5
    small_ids = [reply.json()["id"] for reply in replies]
    positions = [reply.json()["position"] for reply in replies]
    backlog = 300 - free - workers
    # Served next to the backlog, not behind it: one bulk task between two of small's
    # (equal weights; a tie goes to the name that sorts first).
    assert positions == [0, 2, 4, 6, 8]
    assert [small.get(f"/tasks/{i}").json()["position"] for i in small_ids] == positions
    # bulk's last task waits behind the rest of bulk's and all five of small's.
    assert bulk.get(f"/tasks/{bulk_ids[-1]}").json()["position"] == backlog - 1 + 5
    # The class list (what KEDA and `rq info` read) still counts every queued task of
    # both tenants, in arrival order, and the depth each submit saw counted bulk's too.
    assert [int(reply.headers["Gpulane-Queue-Depth"]) for reply in replies] == [
        backlog + n + 1 for n in range(5)
    ]
    assert r.llen(keys.queue(CLS)) == Queue(CLS, connection=r).count == backlog + 5
    assert _queue(r) == bulk_ids[free + workers :] + small_ids
    assert _lane(r, "small") == small_ids and _active(r) == {"bulk", "small"}

    hold.unlink()  # the pool serves on
    for task_id in small_ids:
        wait_status(small, task_id, {"succeeded"}, timeout_s=30)
    after = claims.wait(len(before) + positions[-1] + 1)[len(before) :]
    # Each of small's tasks was claimed within the first slots after it arrived, at
    # exactly the position its submit announced.
    assert [after.index(i) for i in small_ids] == positions
    # Between them, bulk's next tasks in bulk's own order.
    assert [i for i in after[:9] if i not in small_ids] == bulk_ids[
        free + workers : free + workers + 4
    ]


def test_weights_split_a_saturated_pool(
    r: redis.Redis,
    catalog: None,
    tenants: Tenants,
    start_worker: WorkerFactory,
    claims: ClaimLog,
) -> None:
    http = tenants(_tenant("heavy", weight=3), _tenant("light"))
    owner: dict[str, str] = {}
    per_tenant = 200
    for name in ("heavy", "light"):
        client = http[name]
        for _ in range(per_tenant):
            owner[submit(client, "echo")["id"]] = name
    assert r.llen(keys.queue(CLS)) == 2 * per_tenant  # both tenants' tasks, one list
    for n in range(2):
        start_worker(f"fair-weights-{n}", extra=["--tasks", TASKS], fair_share_by="tasks")

    # Both tenants have work throughout the first 200 claims (heavy takes ~150 of them).
    window = [owner[i] for i in claims.wait(per_tenant)[:per_tenant]]
    assert window.count("heavy") < per_tenant and window.count("light") < per_tenant
    ratio = window.count("heavy") / window.count("light")
    assert 2.7 <= ratio <= 3.3, (ratio, window)
    # Not only on average: every stretch of claims keeps close to 3:1.
    heavy = light = 0
    for who in window:
        heavy += who == "heavy"
        light += who == "light"
        assert abs(heavy - 3 * light) <= 4, (heavy, light)

    # Every task runs once and everything drains: no lane is left behind.
    order = claims.wait(2 * per_tenant, timeout_s=60)
    assert sorted(order) == sorted(owner)
    wait_for(lambda: r.zcard(keys.lanes(CLS)) == 0, 10, what="the lanes to drain")
    _assert_drained(r, "heavy", "light")


@pytest.mark.parametrize(
    ("laned", "fair_share", "expected"),
    [
        pytest.param(False, True, "fifo", id="no-tenants"),
        pytest.param(True, False, "fifo", id="fair-share-off"),
        pytest.param(True, True, "alternate", id="fair-share-on"),
    ],
)
def test_without_fair_share_a_class_is_fifo(
    r: redis.Redis,
    catalog: None,
    tenants: Tenants,
    start_worker: WorkerFactory,
    tmp_path: Path,
    laned: bool,
    fair_share: bool,
    expected: str,
) -> None:
    configured = [_tenant("a"), _tenant("b")] if laned else []
    http = tenants(*configured, fair_share=fair_share)
    order = tmp_path / "order"
    tags = [f"a{n}" for n in range(4)] + [f"b{n}" for n in range(4)]
    for tag in tags:  # a's four tasks, then b's four, with no worker yet
        client = http[tag[0] if laned else None]
        submit(client, "test.record", {"path": str(order), "tag": tag})
    if expected == "fifo":
        assert not r.keys(f"{keys.lane(CLS, '*')}") and r.zcard(keys.lanes(CLS)) == 0
    start_worker("fair-fifo", extra=["--tasks", TASKS], fair_share_by="tasks")
    wait_for(
        lambda: order.exists() and len(order.read_text().split()) == len(tags),
        20,
        what="all eight tasks to run",
    )
    ran = order.read_text().split()
    if expected == "fifo":
        assert ran == tags  # submit order
    else:  # the control: lanes take turns
        assert ran == ["a0", "b0", "a1", "b1", "a2", "b2", "a3", "b3"]
    _assert_drained(r, "a", "b")


def test_a_killed_workers_task_goes_back_into_its_lane(
    r: redis.Redis,
    catalog: None,
    tenants: Tenants,
    start_worker: WorkerFactory,
    tmp_path: Path,
) -> None:
    http = tenants(_tenant("alpha"), _tenant("beta"))
    alpha, beta = http["alpha"], http["beta"]
    hold = tmp_path / "hold"
    hold.touch()
    doomed = start_worker("fair-doomed", extra=["--tasks", TASKS], fair_share_by="tasks")
    task = submit(alpha, "test.gate", {"tag": "t", "hold": str(hold)})["id"]
    assert wait_status(alpha, task, {"running"})["worker"] == doomed.name
    wait_for(lambda: Path(f"{hold}.held").exists(), 10, what="the task to hold its worker")
    others = {submit(alpha, "echo")["id"]: alpha for _ in range(2)}
    others.update({submit(beta, "echo")["id"]: beta for _ in range(2)})
    alpha_queued = _lane(r, "alpha")
    assert task not in alpha_queued and len(alpha_queued) == 2

    doomed.kill()  # SIGKILL while it holds a laned task
    record = wait_status(alpha, task, {"queued"}, timeout_s=15)  # the API's reaper
    # First of alpha's again; beta's first goes before it (alpha already had a turn).
    assert record["position"] == 1
    # Back at the head of its lane (taken first, so first again) and of the class list.
    assert _lane(r, "alpha") == [task, *alpha_queued]
    assert _queue(r)[0] == task and r.llen(keys.queue(CLS)) == 5
    assert _active(r) == {"alpha", "beta"}

    hold.unlink()
    rescuer = start_worker("fair-rescuer", extra=["--tasks", TASKS], fair_share_by="tasks")
    done = wait_status(alpha, task, {"succeeded"})
    assert done["attempts"] == 2 and done["worker"] == rescuer.name
    for task_id, client in others.items():
        assert wait_status(client, task_id, {"succeeded"})["attempts"] == 1
    _assert_drained(r, "alpha", "beta")
    assert not r.exists(keys.inflight(doomed.name, CLS), keys.inflight(rescuer.name, CLS))


def test_cancel_takes_a_queued_task_out_of_its_lane(
    r: redis.Redis,
    catalog: None,
    tenants: Tenants,
) -> None:
    http = tenants(_tenant("alpha"), _tenant("beta"))
    alpha, beta = http["alpha"], http["beta"]
    first, middle, last = (submit(alpha, "echo")["id"] for _ in range(3))
    other = submit(beta, "echo")["id"]
    assert _lane(r, "alpha") == [first, middle, last] and _lane(r, "beta") == [other]
    assert alpha.get(f"/tasks/{last}").json()["position"] == 3  # 2 of alpha's, beta's one

    response = alpha.delete(f"/tasks/{middle}")
    assert response.status_code == 200 and response.json()["status"] == "canceled"
    assert _lane(r, "alpha") == [first, last]
    assert _queue(r) == [first, last, other]
    assert alpha.get(f"/tasks/{last}").json()["position"] == 2
    assert _active(r) == {"alpha", "beta"}

    for task_id in (first, last):  # alpha's lane empties: alpha leaves the active set
        assert alpha.delete(f"/tasks/{task_id}").status_code == 200
    assert not r.exists(keys.lane(CLS, "alpha"))
    assert _active(r) == {"beta"} and _queue(r) == [other]
    assert beta.get(f"/tasks/{other}").json()["position"] == 0
