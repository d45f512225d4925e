"""Fair share by device time and device-time usage in the Lua scripts, on the real
Redis: claims charge an estimate, finishes settle it with the measured time, usage
lands in the minute's bucket with each heartbeat, and a device quota refuses with the
time until the hour has rolled off enough. Real worker processes:
tests/test_device_time.py."""

from __future__ import annotations

from collections import Counter

import redis
from support.lua import SETTINGS, claim, finish, register, submit, submit_reply

from dispatcher.api.store import Submission, submit_options
from dispatcher.contract import keys
from dispatcher.contract.jobs import encode_call
from dispatcher.contract.metrics import Drained
from dispatcher.contract.scripts import SyncScripts
from worker.broker import Broker

# What a task of each type "runs" for, in device microseconds.
SHORT_US, LONG_US = 10_000, 500_000


def _serve(
    s: SyncScripts, r: redis.Redis, n: int, fair_time: bool = True
) -> tuple[Counter[str], Counter[str]]:
    """One worker claims and finishes n tasks, each reporting its type's device time;
    the device time and the task count each tenant got."""
    device: Counter[str] = Counter()
    count: Counter[str] = Counter()
    for _ in range(n):
        (task_id,) = claim(s, "w", fair_time=fair_time)
        tenant, task_type = (x.decode() for x in r.hmget(keys.job(task_id), "tenant", "type"))
        us = LONG_US if task_type == "long" else SHORT_US
        assert finish(s, "w", task_id, None, device_us=us if fair_time else None) == b"ok"
        device[tenant] += us
        count[tenant] += 1
    return device, count


def _backlogs(s: SyncScripts, weights: dict[str, float]) -> None:
    for _ in range(300):
        submit(s, tenant="short", task_type="short", weight=weights["short"])
    for _ in range(30):
        submit(s, tenant="long", task_type="long", weight=weights["long"])


def test_equal_weights_split_device_time_not_tasks(r: redis.Redis) -> None:
    s = SyncScripts(r)
    _backlogs(s, {"short": 1, "long": 1})
    register(s, "w")
    device, count = _serve(s, r, 220)
    # 10 ms tasks against 500 ms ones: about 50 short tasks per long one, and the
    # device time within one long task of even (both lanes still hold work).
    assert abs(device["short"] - device["long"]) <= LONG_US + 2 * SHORT_US, device
    assert count["short"] > 20 * count["long"], count


def test_weights_split_device_time_3_to_1(r: redis.Redis) -> None:
    s = SyncScripts(r)
    _backlogs(s, {"short": 1, "long": 3})
    register(s, "w")
    device, _ = _serve(s, r, 160)
    ratio = device["long"] / device["short"]
    assert 2.7 <= ratio <= 3.3, device


def test_tasks_mode_counts_items_whatever_they_cost(r: redis.Redis) -> None:
    s = SyncScripts(r)
    _backlogs(s, {"short": 1, "long": 1})
    register(s, "w")
    device, count = _serve(s, r, 40, fair_time=False)
    assert count["short"] == count["long"] == 20  # turns alternate
    assert device["long"] == 50 * device["short"]  # and the long tenant gets 50x the time


def test_an_unmeasured_type_is_charged_the_fallback_then_its_measured_time(
    r: redis.Redis,
) -> None:
    s = SyncScripts(r)
    first, second = (submit(s, tenant="a", task_type="long", weight=2) for _ in range(2))
    register(s, "w")
    assert claim(s, "w", fair_time=True) == [first]
    # Nothing measured yet: 1 ms per item over weight 2.
    assert int(r.hget(keys.job(first), "fc")) == 500
    assert float(r.zscore(keys.lanes("batch"), "a")) == 500
    assert finish(s, "w", first, None, device_us=LONG_US) == b"ok"
    # Settled: the tag moved by what the task cost (500 ms / 2), and the type's
    # estimate is the measurement.
    assert float(r.zscore(keys.lanes("batch"), "a")) == 250_000
    assert int(r.hget(keys.fair("batch"), "d:long")) == LONG_US
    assert claim(s, "w", fair_time=True) == [second]
    assert int(r.hget(keys.job(second), "fc")) == 250_000
    # Its lane is empty now: the finish settles the idle tenant's saved tag instead.
    assert finish(s, "w", second, None, device_us=2 * LONG_US) == b"ok"
    assert int(r.hget(keys.fair("batch"), "t:a")) == 250_000 + 500_000
    assert int(r.hget(keys.fair("batch"), "d:long")) == LONG_US + (2 * LONG_US - LONG_US) // 5


def test_a_finish_without_device_time_keeps_the_charge(r: redis.Redis) -> None:
    s = SyncScripts(r)
    task_id = submit(s, tenant="a", task_type="long", weight=1)
    submit(s, tenant="a", task_type="long", weight=1)
    register(s, "w")
    claim(s, "w", fair_time=True)
    assert finish(s, "w", task_id, None) == b"ok"  # tasks mode: nothing to settle
    assert float(r.zscore(keys.lanes("batch"), "a")) == 1_000  # the unmeasured charge
    assert r.hget(keys.fair("batch"), "d:long") is None


def _beat(r: redis.Redis, usage: dict[str, int]) -> None:
    broker = Broker(r, SETTINGS, "w", SETTINGS.class_names)
    info = {"state": "idle", "started_ms": "0", "pid": "1", "host": "h", "tasks_done": "0",
            "tasks_failed": "0"}  # fmt: skip
    beat = broker.beat(info, None, Drained(usage=usage), 60.0)
    assert not isinstance(beat.lease, Exception)


def test_a_heartbeat_writes_the_minutes_usage_and_the_counter(r: redis.Redis) -> None:
    register(SyncScripts(r), "w")
    _beat(r, {"acme|batch|embed": 1_500_000, "-|interactive|echo": 250})
    _beat(r, {"acme|batch|embed": 500_000})
    total: Counter[bytes] = Counter()  # over the minutes (one, unless a minute turned)
    minutes = [int(m) for m in r.zrange(keys.USAGE_MINUTES, 0, -1)]
    for minute in minutes:
        for field, value in r.hgetall(keys.usage(minute)).items():
            total[field] += int(value)
        assert 0 < r.ttl(keys.usage(minute)) <= SETTINGS.usage_retention_s
    assert dict(total) == {
        b"u|acme|batch|embed": 2_000_000,
        b"t|acme": 2_000_000,
        b"u|-|interactive|echo": 250,
        b"t|-": 250,
    }
    assert 1 <= len(minutes) <= 2
    assert float(r.hget(keys.METRICS, "c|device|acme|batch|embed")) == 2.0


def _submit_with_quota(s: SyncScripts, quota_s: float) -> list[object]:
    sub = Submission("echo", "batch", {}, 60, "acme", device_quota_s=quota_s)
    opts = submit_options(sub, SETTINGS.classes["batch"], 1, 1.0, SETTINGS)
    return list(s.run("submit", opts, encode_call("echo", {}), ""))


def test_a_device_quota_refuses_until_the_hour_rolls_off(r: redis.Redis) -> None:
    s = SyncScripts(r)
    register(s, "w")
    assert _submit_with_quota(s, 10.0)[0] == b"accepted"
    _beat(r, {"acme|batch|echo": 10_000_000})  # 10 device-seconds, this minute
    reply = _submit_with_quota(s, 10.0)
    assert reply[0] == b"device_quota"
    # That minute's usage leaves the window an hour after the minute ends: within the
    # hour to come (a little less when the minute turned between the beat and here).
    assert 3_480_000 < int(reply[4]) <= 3_600_000
    assert _submit_with_quota(s, 10.5)[0] == b"accepted"  # a bigger quota has room
    assert submit_reply(s, tenant="acme")[0] == b"accepted"  # no quota: not counted
