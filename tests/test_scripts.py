"""The Lua scripts on a real Redis, driven directly: the paths that are hard to reach
through processes (a lease lost while the worker lives on, an outage of the reaper)."""

from __future__ import annotations

import json
import time

import redis
from redis.client import PubSub
from support.lua import CLASSES, SETTINGS, claim, claim_tasks, register, submit
from support.lua import finish as _finish

from dispatcher.api.store import Submission, submit_options
from dispatcher.api.waiters import NOT_FINAL
from dispatcher.contract import keys
from dispatcher.contract.jobs import encode_call
from dispatcher.contract.reap import lease_options, parse_reaped, reap_options
from dispatcher.contract.scripts import SyncScripts, options


def _claim(s: SyncScripts, worker: str, redeliver: bool = False) -> list | None:
    """The one task claimed (claim.lua returns a list of tasks: one unless batched)."""
    tasks = claim_tasks(s, worker, redeliver=redeliver)
    return tasks[0] if tasks else None


def _expire_lease(r: redis.Redis, worker: str) -> None:
    r.zadd(keys.WORKERS, {worker: 0})


def test_task_run_twice_is_reported_by_its_current_attempt(r: redis.Redis) -> None:
    s = SyncScripts(r)
    task_id = submit(s)
    register(s, "slow")
    assert _claim(s, "slow")[0].decode() == task_id
    _expire_lease(r, "slow")  # "slow" lives on but missed its heartbeats
    reaped = parse_reaped(s.run("reap", reap_options(SETTINGS)))
    assert [(x.task_id, x.outcome) for x in reaped] == [(task_id, "requeued")]
    register(s, "fast")
    assert _claim(s, "fast")[3] == 2  # the second attempt
    assert _finish(s, "slow", task_id, {"by": "slow"}, attempt=1) == b"fenced"
    assert r.hget(keys.job(task_id), "status") == b"started"  # untouched
    assert r.llen(keys.control("fast")) == 0  # "fast" runs on
    assert _finish(s, "fast", task_id, {"by": "fast"}, attempt=2) == b"ok"
    assert _finish(s, "fast", task_id, {"by": "fast"}, attempt=2) == b"duplicate"
    assert json.loads(r.hget(keys.job(task_id), "result")) == {"by": "fast"}
    assert r.llen(keys.inflight("fast", "batch")) == 0


def test_late_report_of_a_requeued_task_takes_it_off_the_queue(r: redis.Redis) -> None:
    s = SyncScripts(r)
    task_id = submit(s)
    register(s, "w")
    _claim(s, "w")
    _expire_lease(r, "w")
    s.run("reap", reap_options(SETTINGS))
    assert r.lrange(keys.queue("batch"), 0, -1) == [task_id.encode()]
    assert _finish(s, "w", task_id, {"ok": 1}) == b"ok"
    assert r.llen(keys.queue("batch")) == 0  # nobody runs it a second time


def test_reaper_gives_grace_after_an_outage(r: redis.Redis) -> None:
    s = SyncScripts(r)
    task_id = submit(s)
    register(s, "w")
    _claim(s, "w")
    _expire_lease(r, "w")
    r.set(keys.REAPER_LAST, 1)  # the last pass was long ago: nobody could heartbeat
    assert s.run("reap", reap_options(SETTINGS)) == []
    assert r.zscore(keys.WORKERS, "w") > 0  # one more lease period, not reaped
    assert r.hget(keys.job(task_id), "status") == b"started"


def test_claim_is_priority_ordered_and_parks_when_empty(r: redis.Redis) -> None:
    s = SyncScripts(r)
    batch, interactive = submit(s, "batch"), submit(s, "interactive")
    register(s, "w")
    assert _claim(s, "w")[0].decode() == interactive
    assert _claim(s, "w")[0].decode() == batch
    assert _claim(s, "w") is None
    for cls in ("batch", "interactive"):  # parked (scored by speed and GPU memory)
        assert r.zscore(keys.parked(cls), "w") is not None
    submit(s, "batch")  # rings the parked worker's doorbell and unparks it everywhere
    assert r.llen(keys.wake("w")) == 1
    assert r.zscore(keys.parked("interactive"), "w") is None


def test_cancel_requested_before_a_release_is_kept(r: redis.Redis) -> None:
    """A running task whose client canceled it, then handed back (shutdown or retry):
    it ends canceled instead of running again on the next worker."""
    s = SyncScripts(r)
    task_id = submit(s)
    register(s, "w")
    _claim(s, "w")
    cancel = options(id=task_id, tenant="", any_tenant=True, ttl_s=60)
    assert s.run("cancel", cancel) == [b"cancel_requested"]
    release = options(id=task_id, worker="w", attempt=1, at_head=True, **lease_options(SETTINGS),
                      **{"class": "batch"})  # fmt: skip
    assert s.run("release", release) == b"canceled"
    assert r.hget(keys.job(task_id), "status") == b"canceled"
    assert r.llen(keys.queue("batch")) == 0


def test_an_empty_tenant_is_no_wildcard(r: redis.Redis) -> None:
    """Only an explicit any_tenant flag cancels another tenant's task; '' is a name."""
    s = SyncScripts(r)
    task_id = submit(s)  # tenant "t"
    for tenant in ("", "other"):
        cancel = options(id=task_id, tenant=tenant, ttl_s=60)
        assert s.run("cancel", cancel) == [b"not_found"]
    assert r.hget(keys.job(task_id), "status") == b"queued"
    assert s.run("cancel", options(id=task_id, tenant="t", ttl_s=60))[0] == b"canceled"


def test_a_claim_whose_reply_was_lost_is_redelivered(r: redis.Redis) -> None:
    s = SyncScripts(r)
    first, second = submit(s), submit(s)
    register(s, "w")
    assert _claim(s, "w")[0].decode() == first  # ...and the reply never arrived
    assert _claim(s, "w", redeliver=True)[0].decode() == first  # the same task again
    assert r.lrange(keys.inflight("w", "batch"), 0, -1) == [first.encode()]
    assert r.lrange(keys.queue("batch"), 0, -1) == [second.encode()]


def test_unpark_passes_a_taken_doorbell_on(r: redis.Redis) -> None:
    s = SyncScripts(r)
    for name in ("a", "b"):
        register(s, name)
        assert _claim(s, name) is None  # both park
    submit(s)  # rings one of them
    rung = next(name for name in ("a", "b") if r.llen(keys.wake(name)))
    other = "b" if rung == "a" else "a"
    # The rung worker is stopping: it leaves without claiming and passes the bell on.
    assert s.run("unpark", options(worker=rung, classes=CLASSES)) == 1
    assert r.llen(keys.wake(other)) == 1 and r.llen(keys.wake(rung)) == 0
    assert r.zscore(keys.parked("batch"), rung) is None


def test_grace_after_an_outage_covers_every_lease(r: redis.Redis) -> None:
    s = SyncScripts(r)
    workers = [f"w{i}" for i in range(100)]  # more than one reaper pass handles
    for name in workers:
        register(s, name)
        _expire_lease(r, name)
    r.set(keys.REAPER_LAST, 1)
    assert s.run("reap", reap_options(SETTINGS)) == []
    assert min(score for _, score in r.zrange(keys.WORKERS, 0, -1, withscores=True)) > 0


def test_changes_are_published_and_an_upload_goes_when_its_task_ends(r: redis.Redis) -> None:
    s = SyncScripts(r)
    events = r.pubsub()
    events.subscribe(keys.EVENTS)
    assert events.get_message(timeout=5)["type"] == "subscribe"
    sub = Submission("echo", "batch", {}, timeout_s=60, tenant="t")
    opts = submit_options(sub, SETTINGS.classes["batch"], workers=1, run_s=1.0, settings=SETTINGS)
    task_id = s.run("submit", opts, encode_call("echo", {}), b"%PDF-1.4")[1].decode()
    plain_id = submit(s)
    assert r.exists(keys.file(task_id))
    register(s, "w")
    for claimed in (task_id, plain_id):
        assert _claim(s, "w")[0].decode() == claimed  # started: published
        step = options(id=claimed, worker="w", attempt=1)
        assert s.run("progress", step, json.dumps({"fraction": 0.5, "message": "half"})) == 1
        assert _finish(s, "w", claimed, {}) == b"ok"  # final: published
    assert not r.exists(keys.file(task_id))
    # A marker published last arrives after everything the scripts published before it
    # (one server, one channel, in order): read up to it, with a deadline.
    r.publish(keys.EVENTS, "end of the test")
    published = []
    deadline = time.monotonic() + 10
    while (data := _next_event(events, deadline)) != "end of the test":
        published.append(data)
    # Submit publishes nothing; a start and a progress step say so, an end is the bare id.
    assert published == [
        *(f"{task_id} started", f"{task_id} progress", task_id),
        *(f"{plain_id} started", f"{plain_id} progress", plain_id),
    ]
    # The kinds the scripts publish are the ones the API's waiters read no record for.
    assert {m.partition(" ")[2] for m in published} - {""} == NOT_FINAL
    events.close()


def _next_event(events: PubSub, deadline: float) -> str:
    """The next message's data on a subscription, waiting up to ``deadline``."""
    while True:
        left = deadline - time.monotonic()
        assert left > 0, "no message before the deadline"
        message = events.get_message(timeout=left)
        if message is not None and message["type"] == "message":
            return str(message["data"].decode())


def test_a_dead_workers_task_is_published_when_given_back(r: redis.Redis) -> None:
    s = SyncScripts(r)
    task_id = submit(s)
    register(s, "gone")
    assert _claim(s, "gone")[0].decode() == task_id
    events = r.pubsub()
    events.subscribe(keys.EVENTS)
    assert events.get_message(timeout=5)["type"] == "subscribe"
    _expire_lease(r, "gone")
    reaped = parse_reaped(s.run("reap", reap_options(SETTINGS)))
    assert [(x.task_id, x.outcome) for x in reaped] == [(task_id, "requeued")]
    message = events.get_message(timeout=5)
    assert message is not None and message["data"].decode() == task_id
    events.close()


def test_a_batch_is_the_head_run_of_its_type_and_goes_back_whole(r: redis.Redis) -> None:
    s = SyncScripts(r)
    ids = [submit(s, task_type="emb") for _ in range(3)]
    other, last = submit(s), submit(s, task_type="emb")
    register(s, "w")
    assert claim(s, "w", batch={"emb": 8}) == ids
    assert r.lrange(keys.inflight("w", "batch"), 0, -1) == [i.encode() for i in ids]
    assert {r.hget(keys.job(i), "status") for i in ids} == {b"started"}
    # Waiting for more stops at once: another type heads the queue.
    assert claim_tasks(s, "w", more={"class": "batch", "type": "emb", "n": 5}) == [1]
    # A dead worker's batch goes back to the head, in its order.
    s.run("unregister", options(**lease_options(SETTINGS), worker="w"))
    assert r.lrange(keys.queue("batch"), 0, -1) == [i.encode() for i in [*ids, other, last]]


def test_no_batch_grows_while_a_higher_class_waits(r: redis.Redis) -> None:
    s = SyncScripts(r)
    first, second = submit(s, task_type="emb"), submit(s, task_type="emb")
    register(s, "w")
    assert claim(s, "w", batch={"emb": 1}) == [first]
    urgent = submit(s, "interactive")
    more = {"class": "batch", "type": "emb", "n": 4}
    assert claim_tasks(s, "w", more=more) == [1]  # stop waiting, take nothing
    r.lrem(keys.queue("interactive"), 0, urgent)
    reply = claim_tasks(s, "w", more=more)
    assert reply[0] == 0 and [t[0].decode() for t in reply[1:]] == [second]


def test_every_script_declares_its_flags() -> None:
    """Redis decides before a script runs whether it may run while full (design §6)."""
    from dispatcher.contract.scripts import FLAGS, NAMES, source

    assert set(FLAGS) <= set(NAMES)
    for name in NAMES:
        first = source(name).splitlines()[0]
        assert first == (f"#!lua flags={FLAGS[name]}" if name in FLAGS else "#!lua"), name
    assert FLAGS["get"] == "no-writes"


def test_each_script_carries_only_the_helpers_it_uses() -> None:
    from importlib import resources

    from dispatcher.contract import lualib
    from dispatcher.contract.scripts import NAMES, source

    carried = {name: source(name) for name in NAMES}
    assert "local function lose(" not in carried["get"]  # a read carries no requeue
    assert "local function rq_publish(" not in carried["get"]
    assert "local function fair_ahead(" in carried["get"]  # but its position's helper
    assert "local function reap_worker(" in carried["reap"]
    lua = resources.files("dispatcher.contract") / "lua"
    for name, text in carried.items():
        # Every helper the script, or a library it carries, calls is defined in it.
        libs = lualib.libraries_for((lua / f"{name}.lua").read_text())
        mentioned = lualib._mentions((lua / f"{name}.lua").read_text())
        for lib in libs:
            mentioned |= lualib._mentions(lualib.text(lib))
        for lib in lualib.LIBRARIES:
            for helper in lualib.defined(lib) & mentioned:
                defines = (f"local function {helper}(", f"local {helper} =")
                assert any(d in text for d in defines), (name, helper)


def test_options_reach_lua_unbounded_and_past_64_bits(r: redis.Redis) -> None:
    """An unbounded setting (``max_wait_s = inf``) and a huge device quota in
    microseconds arrive in a script as numbers, not as nil or an encoder error."""
    opts = options(wait=float("inf"), quota_us=round(2e13 * 1e6))
    got = r.eval(
        "local o = cjson.decode(ARGV[1]); "
        "return {tostring(o.wait > 1e308), tostring(o.quota_us > 1.9e19)}",
        0,
        opts,
    )
    assert got == [b"true", b"true"]


def test_each_script_carries_exactly_the_key_builders_it_calls() -> None:
    import re

    from dispatcher.contract.scripts import NAMES, source

    definition = re.compile(r"^(?:function K\.(\w+)\(|K\.(\w+) = ')", re.MULTILINE)
    carried_by = {}
    for name in NAMES:
        text = source(name)
        defined = {a or b for a, b in definition.findall(text)}
        code = "\n".join(
            line.split("--", 1)[0] for line in text.splitlines() if not definition.match(line)
        )
        called = set(re.findall(r"\bK\.(\w+)", code))
        assert called <= defined, (name, called - defined)  # a nil builder fails at run time
        assert defined <= called, (name, defined - called)
        carried_by[name] = defined
    assert "job" in carried_by["finish"]
    assert "rq_worker_executions" not in carried_by["get"]  # a read carries no registry keys


def test_retain_only_ever_lets_a_final_record_go_sooner(r: redis.Redis) -> None:
    """retain.lua (/v1/embeddings' records once answered): a final record's TTL comes
    down to ttl_s; a record with no TTL yet (not final), one already shorter and one that
    is gone are left as they are."""
    s = SyncScripts(r)
    r.hset(keys.job("final"), "status", "finished")
    r.expire(keys.job("final"), 86_400)
    r.hset(keys.job("running"), "status", "started")  # no TTL until final
    r.hset(keys.job("soon"), "status", "finished")
    r.expire(keys.job("soon"), 30)
    shortened = s.run("retain", "300", "final", "running", "soon", "gone")
    assert shortened == 1
    assert 0 < r.ttl(keys.job("final")) <= 300
    assert r.ttl(keys.job("running")) == -1
    assert 0 < r.ttl(keys.job("soon")) <= 30
    assert not r.exists(keys.job("gone"))
