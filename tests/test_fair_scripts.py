"""Fair share and GPU-memory placement in the Lua scripts, on the real Redis: the order
claims serve tenants in, weights, a tenant coming back from idle, cancel and hand-back
inside lanes, positions under fair order, and claims and doorbells that respect what a
worker's card can hold. Real worker processes: tests/test_fair_share.py and
tests/test_placement.py."""

from __future__ import annotations

import asyncio
from collections import Counter

import redis
import redis.asyncio as aioredis
from support.lua import SETTINGS, claim, finish, park_score, register, submit, submit_reply

from dispatcher.api.exporter import parse, pool_families, render
from dispatcher.api.pool import Pool, Snapshot
from dispatcher.contract import keys
from dispatcher.contract.jobs import RECORD_FIELDS
from dispatcher.contract.reap import lease_options, reap_options
from dispatcher.contract.scripts import SyncScripts, options


def _tenant(r: redis.Redis, task_id: str) -> str:
    return str(r.hget(keys.job(task_id), "tenant").decode())


def _position(s: SyncScripts, task_id: str) -> int:
    _, position = s.run("get", task_id, *RECORD_FIELDS)
    return int(position)


def test_without_lanes_a_class_is_fifo(r: redis.Redis) -> None:
    s = SyncScripts(r)
    ids = [submit(s, tenant=t) for t in ("a", "a", "b", "a")]
    register(s, "w")
    assert [claim(s, "w")[0] for _ in ids] == ids
    assert r.zcard(keys.lanes("batch")) == 0


def test_a_small_tenant_is_served_next_to_a_backlog(r: redis.Redis) -> None:
    s = SyncScripts(r)
    bulk = [submit(s, tenant="bulk", weight=1) for _ in range(50)]
    register(s, "w")
    for expected in bulk[:10]:  # a lone tenant: FIFO, the whole pool
        assert claim(s, "w") == [expected]
    small = [submit(s, tenant="small", weight=1) for _ in range(3)]
    assert _position(s, small[0]) == 0  # next, not behind 40 bulk tasks
    order = [_tenant(r, claim(s, "w")[0]) for _ in range(6)]
    assert order.count("small") == 3 and order.index("small") <= 1
    # FIFO inside each tenant; the class list keeps every queued id exactly once.
    assert r.llen(keys.queue("batch")) == 50 - 10 - 3
    assert r.lrange(keys.queue("batch"), 0, -1) == r.lrange(keys.lane("batch", "bulk"), 0, -1)


def test_weights_split_a_saturated_pool(r: redis.Redis) -> None:
    s = SyncScripts(r)
    for _ in range(200):
        submit(s, tenant="heavy", weight=3)
        submit(s, tenant="light", weight=1)
    register(s, "w")
    served = Counter(_tenant(r, claim(s, "w")[0]) for _ in range(200))
    assert served["heavy"] == 150 and served["light"] == 50


def test_an_idle_tenant_banks_no_turns(r: redis.Redis) -> None:
    s = SyncScripts(r)
    register(s, "w")
    claim(s, "w", mem=None)  # parks
    for _ in range(5):
        submit(s, tenant="early", weight=1)
    for _ in range(5):
        claim(s, "w")  # "early" used the pool alone for a while
    for name in ("late", "early"):
        for _ in range(20):
            submit(s, tenant=name, weight=1)
    order = [_tenant(r, claim(s, "w")[0]) for _ in range(20)]
    # "late" was idle, not owed: both alternate from the clock on.
    assert abs(order.count("late") - order.count("early")) <= 1


def test_cancel_and_hand_back_keep_lanes_consistent(r: redis.Redis) -> None:
    s = SyncScripts(r)
    a1, a2 = submit(s, tenant="a", weight=1), submit(s, tenant="a", weight=1)
    b1 = submit(s, tenant="b", weight=1)
    assert s.run("cancel", options(id=b1, tenant="b", ttl_s=60))[0] == b"canceled"
    assert r.zscore(keys.lanes("batch"), "b") is None  # its lane emptied: idle
    assert r.llen(keys.lane("batch", "b")) == 0
    register(s, "w")
    assert claim(s, "w") == [a1]
    release = options(
        **lease_options(SETTINGS), id=a1, worker="w", attempt=1, at_head=True, **{"class": "batch"}
    )
    assert s.run("release", release) == b"released"
    # Back at the head of its lane and of the class list, in order.
    assert r.lrange(keys.lane("batch", "a"), 0, -1) == [a1.encode(), a2.encode()]
    assert r.lrange(keys.queue("batch"), 0, -1) == [a1.encode(), a2.encode()]
    assert claim(s, "w") == [a1]


def test_positions_follow_fair_order(r: redis.Redis) -> None:
    s = SyncScripts(r)
    bulk = [submit(s, tenant="bulk", weight=1) for _ in range(30)]
    small = [submit(s, tenant="small", weight=1) for _ in range(3)]
    assert _position(s, bulk[29]) == 29 + 3  # behind its own 29 and the 3 small ones
    assert [_position(s, t) for t in small] == [1, 3, 5]  # interleaved with bulk
    reply = submit_reply(s, tenant="small", weight=1)
    assert reply[0] == b"accepted" and int(reply[4]) == 7  # what POST /tasks answers
    assert int(reply[2]) == 33  # depth: still the whole class


def test_a_claim_leaves_what_does_not_fit_for_a_bigger_card(r: redis.Redis) -> None:
    s = SyncScripts(r)
    big = submit(s, gpu_mb=40_000)
    small = submit(s, gpu_mb=1_000)
    register(s, "small-card")
    register(s, "big-card")
    assert claim(s, "small-card", mem=24_000) == [small]  # skipped the head
    assert claim(s, "small-card", mem=24_000) == []  # parks: nothing it can hold
    assert r.zscore(keys.parked("batch"), "small-card") == park_score(mem=24_000)
    assert claim(s, "big-card", mem=80_000) == [big]
    # A worker with no limit (the cpu device) takes anything.
    cpu = submit(s, gpu_mb=500_000)
    register(s, "cpu")
    assert claim(s, "cpu") == [cpu]


def test_fit_is_checked_inside_lanes(r: redis.Redis) -> None:
    s = SyncScripts(r)
    big = submit(s, tenant="a", weight=1, gpu_mb=40_000)
    small_a = submit(s, tenant="a", weight=1, gpu_mb=100)
    small_b = submit(s, tenant="b", weight=1, gpu_mb=100)
    register(s, "w")
    assert claim(s, "w", mem=8_000) == [small_a]  # a's head does not fit: its next does
    assert claim(s, "w", mem=8_000) == [small_b]
    assert claim(s, "w", mem=8_000) == []
    assert claim(s, "w", mem=80_000) == [big]
    assert r.zcard(keys.lanes("batch")) == 0 and r.llen(keys.queue("batch")) == 0


def test_a_submit_rings_the_smallest_card_that_fits(r: redis.Redis) -> None:
    s = SyncScripts(r)
    for name, mem in (("w24", 24_000), ("w80", 80_000), ("w48", 48_000)):
        register(s, name)
        assert claim(s, name, mem=mem) == []  # parked, scored by free memory
    submit(s, gpu_mb=30_000)
    assert r.llen(keys.wake("w48")) == 1  # best fit: not the 80 GB card
    assert r.llen(keys.wake("w24")) == 0 and r.llen(keys.wake("w80")) == 0
    submit(s, gpu_mb=100_000)  # fits nobody parked: nobody is rung
    assert r.llen(keys.wake("w24")) == 0 and r.llen(keys.wake("w80")) == 0
    submit(s)  # needs nothing: the smallest card
    assert r.llen(keys.wake("w24")) == 1


def test_a_submit_rings_the_fastest_parked_worker_first(r: redis.Redis) -> None:
    """A pool that mixes GPU generations: speed (rank = 1000 / speed) before memory."""
    s = SyncScripts(r)
    for name, rank, mem in (("slow", 1000, 24_000), ("fast", 500, 80_000), ("cpu", 500, None)):
        register(s, name)
        assert claim(s, name, mem=mem, rank=rank) == []
    submit(s)
    assert r.llen(keys.wake("fast")) == 1  # the fastest; of two, the one with less free
    submit(s)
    assert r.llen(keys.wake("cpu")) == 1
    submit(s, gpu_mb=20_000)  # only the slow card is left
    assert r.llen(keys.wake("slow")) == 1


def test_no_fitting_worker_is_refused_at_admission(r: redis.Redis) -> None:
    s = SyncScripts(r)
    reply = submit_reply(s, gpu_mb=90_000, workers=0, serving=2)  # 2 serve, none fits
    assert reply[0] == b"no_workers"
    assert r.llen(keys.queue("batch")) == 0


def test_each_tenants_queue_is_in_the_snapshot_and_the_metrics(
    r: redis.Redis, redis_url: str
) -> None:
    s = SyncScripts(r)
    for tenant, n in (("bulk", 4), ("small", 1)):
        for _ in range(n):
            submit(s, tenant=tenant, weight=1)
    submit(s, "interactive", tenant="bulk", weight=1)

    async def read() -> Snapshot:
        client = aioredis.Redis.from_url(redis_url)
        try:
            return await Pool(client, SETTINGS).snapshot()
        finally:
            await client.aclose()

    snap = asyncio.run(read())
    assert dict(snap.classes["batch"].tenants) == {"bulk": 4, "small": 1}
    assert dict(snap.classes["interactive"].tenants) == {"bulk": 1}
    assert snap.classes["batch"].depth == 5  # the class queue counts them all
    text = render(pool_families(parse({}), snap))[0].decode()
    assert 'gpulane_tenant_queued_tasks{class="batch",tenant="bulk"} 4.0' in text
    assert 'gpulane_tenant_queued_tasks{class="batch",tenant="small"} 1.0' in text


def test_tasks_queued_without_a_lane_are_not_starved_by_laned_ones(r: redis.Redis) -> None:
    """Fair share turned on with tasks queued: those are served as they reach the head,
    whatever stream of laned work follows."""
    s = SyncScripts(r)
    old = [submit(s, tenant="a") for _ in range(2)]  # no weight: no lane (fair share off)
    laned_a = submit(s, tenant="a", weight=1)
    middle = submit(s, tenant="b")  # no lane, behind a laned task
    laned = [submit(s, tenant=t, weight=1) for t in ("b", "c", "b", "c")]
    register(s, "w")
    assert [claim(s, "w")[0] for _ in range(2)] == old  # the head first, in order
    taken = [claim(s, "w")[0] for _ in range(3)]
    assert taken[0] == laned_a  # a's lane had the smallest tag (ties: the name)
    assert taken[1] == middle  # once laned_a left the head, the lane-less task was next
    assert sorted(taken + [claim(s, "w")[0] for _ in range(3)]) == sorted([laned_a, middle, *laned])
    assert r.llen(keys.queue("batch")) == 0 and r.zcard(keys.lanes("batch")) == 0


def test_a_result_from_a_worker_presumed_dead_takes_the_task_out_of_its_lane(
    r: redis.Redis,
) -> None:
    """A worker lost its lease (a partition), the reaper put its task back in the queue
    and its lane, and nobody started it again: the late report is kept and the task
    leaves both lists."""
    s = SyncScripts(r)
    task_id = submit(s, tenant="a", weight=1)
    other = submit(s, tenant="a", weight=1)
    register(s, "w")
    assert claim(s, "w") == [task_id]
    r.zadd(keys.WORKERS, {"w": 0})  # its lease ran out
    (line,) = s.run("reap", reap_options(SETTINGS))
    assert line.decode().endswith("|requeued|1")  # outcome, then the items it held
    assert r.lrange(keys.lane("batch", "a"), 0, -1) == [task_id.encode(), other.encode()]
    assert finish(s, "w", task_id, {}) == b"ok"
    assert r.lrange(keys.lane("batch", "a"), 0, -1) == [other.encode()]
    assert r.lrange(keys.queue("batch"), 0, -1) == [other.encode()]


def _age(r: redis.Redis, task_id: str, by_ms: int = 10**7) -> None:
    created = int(r.hget(keys.job(task_id), "created_ms"))
    r.hset(keys.job(task_id), "created_ms", created - by_ms)


AGING = {"batch": 300_000}


def test_aging_promotes_the_aged_task_itself_under_fair_share(r: redis.Redis) -> None:
    """The batch head waited past promote_after_s: it (and only it) goes before the
    interactive work, not a young batch task that fair order would pick."""
    s = SyncScripts(r)
    first, old = submit(s, tenant="a", weight=0.05), submit(s, tenant="a", weight=0.05)
    register(s, "w")
    assert claim(s, "w") == [first]  # a had its turn: its next tag is 20 of b's turns on
    _age(r, old)
    young = [submit(s, tenant="b", weight=1) for _ in range(5)]
    urgent = [submit(s, "interactive", tenant="b", weight=1) for _ in range(3)]
    order = [claim(s, "w", aging=AGING)[0] for _ in range(9)]
    assert order[0] == old
    assert order[1:4] == urgent  # then interactive first again: batch's head is young
    assert order[4:] == young


def test_an_aged_laned_task_whose_lane_index_was_lost_is_still_served(r: redis.Redis) -> None:
    """The lanes' index lost its tenant (keys lost in a failover, an operator's DEL):
    charging the turn falls back to the tenant's saved tag instead of failing the
    claim after the task was already moved."""
    s = SyncScripts(r)
    old = submit(s, tenant="a", weight=1)
    register(s, "w")
    _age(r, old)
    urgent = submit(s, "interactive", tenant="a", weight=1)
    r.delete(keys.lanes("batch"))
    assert claim(s, "w", aging=AGING) == [old]  # promoted past the interactive task
    assert r.hget(keys.job(old), "status") == b"started"
    assert claim(s, "w", aging=AGING) == [urgent]


def test_aging_promotes_only_a_head_this_worker_can_hold(r: redis.Redis) -> None:
    s = SyncScripts(r)
    big = submit(s, gpu_mb=40_000)
    _age(r, big)
    young = submit(s)
    urgent = [submit(s, "interactive") for _ in range(2)]
    register(s, "small")
    # The aged head does not fit: no promotion, and no young batch task in its stead.
    assert [claim(s, "small", mem=24_000, aging=AGING)[0] for _ in range(3)] == [
        *urgent,
        young,
    ]
    register(s, "big")
    assert claim(s, "big", mem=80_000, aging=AGING) == [big]


def test_a_batch_takes_the_next_tasks_in_fair_order(r: redis.Redis) -> None:
    s = SyncScripts(r)
    a = [submit(s, tenant="a", weight=1, task_type="test.batch_echo") for _ in range(4)]
    b = [submit(s, tenant="b", weight=1, task_type="test.batch_echo") for _ in range(2)]
    other = submit(s, tenant="c", weight=1)  # another type: ends the batch when it is next
    register(s, "w")
    batch = claim(s, "w", batch={"test.batch_echo": 8})
    assert batch == [a[0], b[0]]  # tenants' first turns; c's echo (also tag 0) ends it
    assert claim(s, "w") == [other]
    assert claim(s, "w", batch={"test.batch_echo": 8}) == [a[1], b[1], a[2], a[3]]
    assert r.llen(keys.queue("batch")) == 0 and r.zcard(keys.lanes("batch")) == 0


def test_a_big_task_rings_a_big_card_behind_many_small_ones(r: redis.Redis) -> None:
    s = SyncScripts(r)
    for i in range(300):  # more small cards than any scan would look through
        register(s, f"small{i:03d}")
        assert claim(s, f"small{i:03d}", mem=24_000) == []
    register(s, "big")
    assert claim(s, "big", mem=80_000) == []
    register(s, "slow-big")
    assert claim(s, "slow-big", mem=80_000, rank=2000) == []  # half as fast
    submit(s, gpu_mb=40_000)
    assert r.llen(keys.wake("big")) == 1  # the fast band's only fit
    submit(s, gpu_mb=40_000)
    assert r.llen(keys.wake("slow-big")) == 1  # then the slower band's


def test_a_leftover_idle_set_of_an_earlier_version_is_ignored(r: redis.Redis) -> None:
    s = SyncScripts(r)
    r.sadd("gpulane:idle:batch", "old-worker")  # the SET earlier versions parked in
    register(s, "w")
    assert claim(s, "w") == []
    task_id = submit(s)
    assert claim(s, "w") == [task_id]


def test_positions_match_the_claim_order_with_uneven_weights(r: redis.Redis) -> None:
    """With everything queued, each task's position is exactly its index in the claim
    order: tags are whole numbers, so ties are real and broken as the claims break them."""
    s = SyncScripts(r)
    ids = [
        submit(s, tenant=tenant, weight=weight)
        for _ in range(40)
        for tenant, weight in (("b-heavy", 3), ("a-light", 1), ("c-odd", 0.7))
    ]
    positions = {task_id: _position(s, task_id) for task_id in ids}
    register(s, "w")
    order = [claim(s, "w")[0] for _ in ids]
    assert [positions[task_id] for task_id in order] == list(range(len(ids)))


def test_a_big_tasks_estimate_drains_the_queue_at_the_whole_class_pace(
    r: redis.Redis,
) -> None:
    """9 tasks ahead, 10 workers, 1 of them with a card big enough, 1 s per task: the
    tasks ahead take 0.9 s, then the big one waits for its card (1 s), not 10 s."""
    s = SyncScripts(r)
    for _ in range(9):
        submit(s)
    reply = submit_reply(s, gpu_mb=40_000, workers=1, serving=10)
    assert reply[0] == b"accepted" and int(reply[3]) == 1900
    assert int(submit_reply(s, workers=10, serving=10)[3]) == 1100  # (10 + 1) / 10 s


def test_a_task_too_big_for_this_card_in_a_higher_class_does_not_stop_a_batch(
    r: redis.Redis,
) -> None:
    s = SyncScripts(r)
    submit(s, "interactive", gpu_mb=40_000)  # no use to a 24 GB card
    ids = [submit(s, task_type="test.batch_echo") for _ in range(4)]
    register(s, "w")
    assert claim(s, "w", mem=24_000, batch={"test.batch_echo": 8}) == ids


def test_a_stopping_worker_passes_its_doorbell_to_one_that_can_hold_the_task(
    r: redis.Redis,
) -> None:
    s = SyncScripts(r)
    for name, mem in (("small", 24_000), ("big", 80_000), ("big2", 80_000)):
        register(s, name)
        assert claim(s, name, mem=mem) == []
    submit(s, gpu_mb=40_000)
    assert r.llen(keys.wake("big")) == 1
    assert s.run("unpark", options(worker="big", classes=SETTINGS.class_names)) == 1
    assert r.llen(keys.wake("big2")) == 1 and r.llen(keys.wake("small")) == 0
