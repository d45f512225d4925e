"""A heartbeat whose reply is lost (a reset or a timeout after Redis ran it) on a real
Redis: sent again, it folds its metrics once, and the cancels it collected still reach
the worker (they leave the control list only once a later beat says they arrived)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from redis.connection import Connection
from support.lua import CLASSES, SETTINGS, claim, register, submit

from dispatcher.contract import keys
from dispatcher.contract.metrics import Recorder
from dispatcher.contract.scripts import SyncScripts, options
from worker.broker import Broker
from worker.execute import Interrupts, RunningTask
from worker.heartbeat import Heartbeat
from worker.state import WorkerState

NAME = "hb-worker"
FIELD = "c|finished|batch|echo|succeeded"  # a counter as the recorder names it


def _beat(s: SyncScripts, seq: str, ack: list[str], n: int = 1) -> list[str]:
    """One heartbeat.lua call counting ``n``; the cancels it returned."""
    opts = options(worker=NAME, ttl_ms=5000, tau_s=20, info={}, counters={FIELD: n},
                   floats={}, runs={}, seq=seq, ack=ack,
                   rq={"fields": {}, "queues": CLASSES, "execution": None})  # fmt: skip
    return [c.decode() for c in s.run("heartbeat", opts)[1]]


def _count(r: redis.Redis) -> int:
    return int(r.hget(keys.METRICS, FIELD) or 0)


def test_a_beat_sent_again_folds_once_and_cancels_leave_only_when_acked(
    r: redis.Redis,
) -> None:
    s = SyncScripts(r)
    register(s, NAME)
    r.rpush(keys.control(NAME), "t1")
    assert _beat(s, "p:1", []) == ["t1"]
    assert _beat(s, "p:1", []) == ["t1"]  # its reply was lost: the same beat again
    r.delete(keys.worker(NAME))  # reaped meanwhile (or re-registered): the hash goes
    assert _beat(s, "p:1", []) == ["t1"]
    assert _count(r) == 1
    r.rpush(keys.control(NAME), "t2")
    assert _beat(s, "p:2", ["t1"]) == ["t2"]  # t1 arrived: it leaves the list
    assert _count(r) == 2
    # The reaper emptied the list (a lease lost) and a new cancel came: an ack by id
    # takes only what arrived.
    r.delete(keys.control(NAME))
    r.rpush(keys.control(NAME), "t3")
    assert _beat(s, "p:3", ["t2"]) == ["t3"]
    assert _beat(s, "p:4", ["t3"]) == []
    assert _count(r) == 4
    assert _beat(s, "", [], 5) == [] and _beat(s, "", [], 5) == []  # unnamed: always folds
    assert _count(r) == 14


class Runs:
    """The heartbeat's view of the main thread's runs: none in progress; cancels seen."""

    current: RunningTask | None = None

    def __init__(self) -> None:
        self.canceled: list[str] = []

    def cancel(self, task_id: str) -> None:
        self.canceled.append(task_id)


@pytest.fixture
def heartbeat(redis_url: str) -> Iterator[tuple[Heartbeat, Recorder, Runs]]:
    client = redis.Redis.from_url(redis_url)
    broker = Broker(client, SETTINGS, NAME, SETTINGS.class_names)
    recorder, runs = Recorder(), Runs()
    state = WorkerState(NAME, None, SETTINGS.class_names, ["echo"])
    yield Heartbeat(broker, state, recorder, runs, Interrupts(), SETTINGS), recorder, runs
    client.close()


def test_a_lost_reply_neither_counts_twice_nor_loses_a_cancel(
    r: redis.Redis,
    heartbeat: tuple[Heartbeat, Recorder, Runs],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hb, recorder, runs = heartbeat
    s = SyncScripts(r)
    register(s, NAME)
    hb.beat()  # its connection open, the worker listed
    task_id = submit(s)
    assert claim(s, NAME) == [task_id]
    r.rpush(keys.control(NAME), task_id)  # as cancel.lua tells the worker running it
    recorder.count("finished", "batch", "echo", "succeeded", n=3)
    read = Connection.read_response
    lost: list[object] = []

    def reply_lost(self: Connection, *args: object, **kwargs: object) -> object:
        reply = read(self, *args, **kwargs)
        if not lost:  # the beat's scripts ran; their replies never reach the worker
            lost.append(reply)
            raise redis.ConnectionError("Connection reset by peer")
        return reply

    monkeypatch.setattr(Connection, "read_response", reply_lost)
    with pytest.raises(redis.ConnectionError):
        hb.beat()
    assert _count(r) == 3 and runs.canceled == []  # it ran; nothing reached the worker
    recorder.count("finished", "batch", "echo", "succeeded", n=2)
    hb.beat()  # the lost beat again (the cancel arrives), then a new one (its ack)
    assert _count(r) == 5  # 3 once, then 2
    assert runs.canceled == [task_id]
    assert r.lrange(keys.control(NAME), 0, -1) == []
    assert not recorder.drain()  # nothing left behind
