"""The worker's units in-process against the real Redis fixture: the hand-back and the
watchdog, driven directly instead of through a process (no fakeredis: it cannot run
the project's Lua scripts faithfully, and these paths are all scripts)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from conftest import make_settings

from dispatcher.api.store import Submission, submit_options
from dispatcher.contract import keys
from dispatcher.contract.exits import EXIT_STUCK
from dispatcher.contract.jobs import encode_call
from dispatcher.contract.metrics import Recorder
from dispatcher.contract.scripts import SyncScripts
from dispatcher.contract.settings import Settings
from worker.broker import Broker
from worker.claims import Claimed
from worker.execute import RunningTask, TaskHandback, TaskInterrupt
from worker.handback import hand_back
from worker.state import WorkerState
from worker.watchdog import Watchdog

NAME = "unit-worker"


@pytest.fixture
def settings(redis_url: str) -> Settings:
    return make_settings(redis_url, shutdown_grace_s=0.0, timeout_grace_s=0.0)


@pytest.fixture
def broker(r: redis.Redis, settings: Settings) -> Iterator[Broker]:
    broker = Broker(r, settings, NAME, settings.class_names)
    state = WorkerState(NAME, None, settings.class_names, ["echo"])
    assert broker.register(state.info(), {}) is not None
    yield broker


def _submit(r: redis.Redis, settings: Settings, n: int = 1) -> list[str]:
    scripts = SyncScripts(r)
    ids = []
    for i in range(n):
        sub = Submission("echo", "batch", {"i": i}, timeout_s=60, tenant="t")
        opts = submit_options(sub, settings.classes["batch"], 1, 1.0, settings)
        reply = scripts.run("submit", opts, encode_call("echo", {"i": i}), "")
        ids.append(bytes(reply[1]).decode())
    return ids


def _queue(r: redis.Redis) -> list[str]:
    return [x.decode() for x in r.lrange(keys.queue("batch"), 0, -1)]


def _claim(broker: Broker) -> Claimed:
    claimed = broker.claim(False, "{}")
    assert len(claimed) == 1  # echo is not batched: one task
    return claimed[0]


def test_hand_back_with_a_fault_is_a_lost_attempt(
    r: redis.Redis, settings: Settings, broker: Broker
) -> None:
    (task,) = _submit(r, settings)
    claimed = _claim(broker)
    fault = {"code": "gpu_fault", "message": "the card fell off the bus"}
    recorder = Recorder()
    verdict = hand_back(broker, recorder, claimed, "echo", at_head=True, fault=fault, why="t")
    assert verdict == "requeued"
    assert r.hget(keys.job(task), "lost") == b"1"
    assert _queue(r) == [task]
    assert r.llen(keys.inflight(NAME, "batch")) == 0


def test_hand_back_for_a_retry_goes_to_the_tail(
    r: redis.Redis, settings: Settings, broker: Broker
) -> None:
    first, second = _submit(r, settings, 2)
    claimed = _claim(broker)
    assert claimed.task_id == first
    verdict = hand_back(broker, Recorder(), claimed, "echo", at_head=False, why="retry")
    assert verdict == "released"
    assert _queue(r) == [second, first]
    assert r.hget(keys.job(first), "lost") in (None, b"0")  # not a lost attempt


class _Interrupts:
    def __init__(self) -> None:
        self.requested: list[type[TaskInterrupt]] = []

    def request(self, kind: type[TaskInterrupt], run: object, reason: str = "") -> None:
        self.requested.append(kind)


class _Runner:
    def __init__(self, current: RunningTask | None) -> None:
        self.current = current


class _Exited(Exception):
    def __init__(self, status: int) -> None:
        self.status = status


def _watchdog(
    broker: Broker, settings: Settings, claimed: Claimed, monkeypatch: pytest.MonkeyPatch
) -> tuple[Watchdog, WorkerState, _Interrupts, list[str]]:
    def exit_(status: int) -> None:
        raise _Exited(status)

    monkeypatch.setattr("worker.watchdog.os._exit", exit_)
    state = WorkerState(NAME, None, settings.class_names, ["echo"])
    running = RunningTask(claimed, "echo", None, {}, lambda *a: None, NAME)
    interrupts = _Interrupts()
    flushed: list[str] = []
    dog = Watchdog(
        broker, state, Recorder(), _Runner(running), interrupts, settings,  # type: ignore[arg-type]
        lambda: flushed.append("beat"),
    )  # fmt: skip
    return dog, state, interrupts, flushed


def test_watchdog_hands_back_once_after_the_shutdown_grace(
    r: redis.Redis, settings: Settings, broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    _submit(r, settings)
    dog, state, interrupts, _ = _watchdog(broker, settings, _claim(broker), monkeypatch)
    dog.check()
    assert interrupts.requested == []  # not stopping: nothing to do
    state.request_stop()
    dog.check()
    dog.check()
    assert interrupts.requested == [TaskHandback]


def test_watchdog_reports_a_stuck_task_and_ends_the_process(
    r: redis.Redis, settings: Settings, broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    (task,) = _submit(r, settings)
    claimed = dataclasses.replace(_claim(broker), timeout_s=0.0)
    dog, _, _, flushed = _watchdog(broker, settings, claimed, monkeypatch)
    with pytest.raises(_Exited) as exited:
        dog.check()
    assert exited.value.status == EXIT_STUCK
    assert flushed == ["beat"]  # metrics flushed before the exit
    fields = r.hmget(keys.job(task), "status", "error")
    assert fields[0] == b"failed"
    error: dict[str, Any] = json.loads(fields[1] or b"{}")
    assert error["code"] == "timeout"


def test_register_refuses_a_name_held_by_a_live_worker(
    r: redis.Redis, settings: Settings, broker: Broker
) -> None:
    lease = r.zscore(keys.WORKERS, NAME)
    other = Broker(r, settings, NAME, settings.class_names)
    state = WorkerState(NAME, None, settings.class_names, ["echo"])  # another instance
    assert other.register(state.info(), {}) is None
    assert r.zscore(keys.WORKERS, NAME) == lease  # the live worker's lease is untouched


def test_claim_options_are_remembered_by_everything_they_depend_on(broker: Broker) -> None:
    """A busy worker sends the same claim with every report: encoded once, and encoded
    anew whenever an argument (or a backend's routed types, set after start) differs."""
    first = broker.claim_options(False, '"cpu"', False, {"embed": 64}, 1000)
    assert broker.claim_options(False, '"cpu"', False, {"embed": 64}, 1000) is first
    assert json.loads(broker.claim_options(False, '"cpu"', False, {"embed": 64}, 900))["mem"] == 900
    assert json.loads(broker.claim_options(False, '"cpu"', True, {"embed": 64}, 1000))["redeliver"]
    assert json.loads(broker.claim_options(False, '"cpu"', False, {"embed": 8}, 1000))["batch"] == {
        "embed": 8
    }
    assert "types" not in json.loads(first)
    broker.types = ["llm.tiny"]
    again = json.loads(broker.claim_options(False, '"cpu"', False, {"embed": 64}, 1000))
    assert again["types"] == ["llm.tiny"]


def test_a_redelivery_hands_back_every_class_but_the_attempts_running(
    r: redis.Redis, settings: Settings, broker: Broker
) -> None:
    """A claim's lost reply is asked for again with redeliver: every task the worker
    holds comes back, of every class, but the attempts it says it runs (a backend
    worker's other slots): those must not start a second relay. A later attempt of one
    still comes back."""
    scripts = SyncScripts(r)
    ids = []
    for cls in ("batch", "interactive"):
        sub = Submission("echo", cls, {}, timeout_s=60, tenant="t")
        opts = submit_options(sub, settings.classes[cls], 1, 1.0, settings)
        ids.append(bytes(scripts.run("submit", opts, encode_call("echo", {}), "")[1]).decode())
    batch, interactive = ids
    slot = broker.claim(False, "{}")[0]  # a slot runs the interactive task...
    assert slot.task_id == interactive
    assert broker.claim(False, "{}")[0].task_id == batch  # ...and this reply was lost
    running = {interactive: slot.attempt}

    def redelivered(running: dict[str, int] | None) -> list[str]:
        return sorted(c.task_id for c in broker.claim(False, "{}", True, running=running))

    assert redelivered(running) == [batch]
    assert redelivered(None) == sorted(ids)  # an in-process worker runs nothing meanwhile
    assert redelivered({interactive: slot.attempt + 1}) == sorted(ids)  # not that attempt
