"""The worker's reporter in-process against the real Redis fixture: a batch's outcomes
go to Redis in one round trip, a report Redis refuses for now (full) is held and
retried until it lands, and one refused for good (a script error) does not stop the
others of its batch from being recorded."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import redis
from support.lua import submit

from dispatcher.contract import keys
from dispatcher.contract.backoff import Backoff
from dispatcher.contract.metrics import Recorder
from dispatcher.contract.scripts import SyncScripts
from dispatcher.contract.settings import Settings
from testkit import wait_for
from worker.broker import Broker
from worker.claims import Claimed
from worker.execute import Outcome, RunEnd
from worker.report import Concluded, Reporter
from worker.state import WorkerState

NAME = "report-worker"
TYPE = "test.batch_echo"  # batched (max size 4): one claim takes the batch


@pytest.fixture
def state(settings: Settings) -> WorkerState:
    return WorkerState(NAME, None, settings.class_names, [TYPE])


@pytest.fixture
def broker(r: redis.Redis, settings: Settings, state: WorkerState) -> Iterator[Broker]:
    broker = Broker(r, settings, NAME, settings.class_names)
    assert broker.register(state.info(), {}) is not None
    yield broker


@pytest.fixture
def reporter(broker: Broker, state: WorkerState, settings: Settings) -> Reporter:
    return Reporter(broker, Recorder(), state, settings, Backoff(initial_s=0.01, cap_s=0.05))


def _batch(r: redis.Redis, settings: Settings, broker: Broker, n: int) -> list[Claimed]:
    """``n`` tasks of the batched type, submitted and claimed as one batch."""
    scripts = SyncScripts(r)
    for _ in range(n):
        submit(scripts, task_type=TYPE, settings=settings)
    claims = broker.claim(False, "{}", batch={TYPE: n})
    assert len(claims) == n
    return claims


def _runs(claims: list[Claimed]) -> list[Concluded]:
    return [
        Concluded(c, Outcome(RunEnd.FINISHED, result_json=f'{{"value":{k}}}'), None)
        for k, c in enumerate(claims)
    ]


def _status(r: redis.Redis, claimed: Claimed) -> str | None:
    value = r.hget(keys.job(claimed.task_id), "status")
    return value.decode() if isinstance(value, bytes) else value


def test_a_batch_is_reported_in_one_round_trip(
    r: redis.Redis, settings: Settings, broker: Broker, reporter: Reporter, round_trips: list[bytes]
) -> None:
    # A Redis that lost the scripts (restarted, flushed) answers NOSCRIPT: the reporter
    # loads finish.lua and sends again what did not run.
    first = _batch(r, settings, broker, 2)
    r.script_flush()
    assert all(ms is not None for ms in reporter.report(_runs(first)))
    assert [_status(r, c) for c in first] == ["finished"] * 2
    claims = _batch(r, settings, broker, 4)
    round_trips.clear()
    ended = reporter.report(_runs(claims))
    assert len(round_trips) == 1  # one finish.lua call for the four, nothing before
    assert all(ms is not None for ms in ended)
    assert [_status(r, c) for c in claims] == ["finished"] * 4
    assert r.llen(keys.inflight(NAME, "batch")) == 0


def test_the_next_claim_rides_with_the_report(
    r: redis.Redis, settings: Settings, broker: Broker, reporter: Reporter, round_trips: list[bytes]
) -> None:
    """A busy worker spends one round trip per task: the report and the next claim go
    in one packet, and the claim's tasks come back with the reports' answers."""
    reporter.report(_runs(_batch(r, settings, broker, 1)))  # finish.lua loaded
    first = _batch(r, settings, broker, 2)
    scripts = SyncScripts(r)
    queued = [submit(scripts, task_type=TYPE, settings=settings) for _ in range(3)]
    round_trips.clear()
    opts = broker.claim_options(False, "{}", batch={TYPE: 4})
    ended = reporter.report(_runs(first), opts)
    assert len(round_trips) == 1  # the finish.lua call for two and the claim in one packet
    assert all(ms is not None for ms in ended)
    assert reporter.claimed is not None and not reporter.claim_lost
    assert [c.task_id for c in reporter.claimed] == queued
    assert [_status(r, c) for c in reporter.claimed] == ["started"] * 3
    # A run handed back (not final) goes before any claim: no claim rides then.
    handback = [Concluded(reporter.claimed[0], Outcome(RunEnd.RELEASE), None)]
    reporter.report(handback, broker.claim_options(False, "{}"))
    assert reporter.claimed is None and _status(r, handback[0].claimed) == "queued"


def test_a_full_redis_holds_the_reports_until_it_has_room(
    r: redis.Redis, settings: Settings, broker: Broker, reporter: Reporter, state: WorkerState
) -> None:
    claims = _batch(r, settings, broker, 3)
    before = str(r.config_get("maxmemory")["maxmemory"])
    r.config_set("maxmemory", 1)  # every write script is refused whole (OOM)
    try:
        ended: list[list[int | None]] = []
        thread = threading.Thread(target=lambda: ended.append(reporter.report(_runs(claims))))
        thread.start()
        wait_for(lambda: "redis is full" in state.reason or None, 10, what="the held reports")
        assert [_status(r, c) for c in claims] == ["started"] * 3
    finally:
        r.config_set("maxmemory", before)
    thread.join(10)
    assert not thread.is_alive()
    assert [_status(r, c) for c in claims] == ["finished"] * 3
    assert all(ms is not None for ms in ended[0])


def test_a_report_refused_for_good_leaves_the_others_recorded(
    r: redis.Redis,
    settings: Settings,
    broker: Broker,
    reporter: Reporter,
    state: WorkerState,
    caplog: pytest.LogCaptureFixture,
) -> None:
    claims = _batch(r, settings, broker, 3)
    broken = claims[1]
    r.delete(keys.job(broken.task_id))
    r.set(keys.job(broken.task_id), "not a hash")  # finish.lua fails on it: WRONGTYPE
    ended = reporter.report(_runs(claims))
    assert ended[1] is None and ended[0] is not None and ended[2] is not None
    assert [_status(r, c) for c in (claims[0], claims[2])] == ["finished"] * 2
    assert state.unhealthy  # a script error: the worker leaves to be restarted
    refusals = [rec for rec in caplog.records if rec.getMessage().startswith("redis refused")]
    assert [getattr(rec, "task", None) for rec in refusals] == [broken.task_id]


def test_reports_the_replicas_did_not_confirm_are_sent_again_and_keep_their_times(
    r: redis.Redis, settings: Settings, broker: Broker, state: WorkerState
) -> None:
    """With min_replica_acks and no replica, every report is written but unconfirmed:
    sent again until a stop past the grace gives up. The times of the first writes are
    kept (the second answer is 'duplicate'), so the tasks are still counted."""
    claims = _batch(r, settings, broker, 2)
    acked = settings.model_copy(
        update={"min_replica_acks": 1, "replica_ack_timeout_s": 0.01, "shutdown_grace_s": 0.0}
    )
    lagging = Broker(r, acked, NAME, acked.class_names)  # the same worker, waiting for acks
    reporter = Reporter(lagging, Recorder(), state, acked, Backoff(initial_s=0.01, cap_s=0.05))
    ended: list[list[int | None]] = []
    thread = threading.Thread(target=lambda: ended.append(reporter.report(_runs(claims))))
    thread.start()
    try:
        wait_for(
            lambda: [_status(r, c) for c in claims] == ["finished"] * 2 or None,
            10,
            what="the unconfirmed reports written",
        )
    finally:
        state.request_stop()  # past shutdown_grace_s 0: the next wait gives up
        thread.join(10)
    assert not thread.is_alive()
    assert len(ended[0]) == 2 and all(ms is not None for ms in ended[0])
