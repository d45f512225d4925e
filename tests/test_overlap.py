"""Report overlap (``report_overlap``, worker/overlap.py), in process against the real
Redis fixture: the worker's own loop, broker, runner and reporter, with the background
report held at a gate the test opens, so each interleaving is made, not hoped for.

The loop runs on the main thread, as in a worker (its interrupts are signals); a
controller thread holds and opens the gate and records what it saw, which the test
asserts once the loop has returned."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis
from conftest import make_settings
from pydantic import BaseModel
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from support.lua import submit

from dispatcher.contract import keys
from dispatcher.contract.metrics import Recorder
from dispatcher.contract.scripts import SyncScripts
from dispatcher.contract.settings import ReportOverlap, Settings
from testkit import wait_for
from worker.broker import Broker
from worker.claims import Claimed, Finished, Report
from worker.execute import Interrupts, Runner
from worker.loop import WorkerLoop
from worker.overlap import InFlight, Settled, overlaps
from worker.registry import Batch, Registry, TaskContext
from worker.report import Concluded
from worker.state import WorkerState

NAME = "overlap-worker"
TYPE = "test.overlap"
SIZE = 4  # items per batch


class Args(BaseModel):
    value: int


class GatedBroker(Broker):
    """The worker's broker, whose reports without a claim (the background reporter's:
    inline reports carry the next claim) wait at a gate. Counts the reports sent; fails
    the next ``lose_claims`` claims as a lost connection would, before they are sent."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.gate.set()
        self.sent = 0
        self.lose_claims = 0
        self.refuse_claims = False  # as a script error would: for good

    def claim(self, *args: Any, **kwargs: Any) -> list[Claimed]:
        if self.refuse_claims:
            raise ResponseError("ERR user_script:1: something broke (test)")
        if self.lose_claims:
            self.lose_claims -= 1
            raise RedisConnectionError("connection lost (test)")
        return super().claim(*args, **kwargs)

    def finish_many(self, reports: Sequence[Report]) -> list[Finished | Any]:
        self.sent += 1
        self.gate.wait(30)
        return super().finish_many(reports)


@dataclass
class Pool:
    """One worker's parts, its batches as the handler saw them, and a hook the loop
    calls each time it waits for the report in flight."""

    r: redis.Redis
    broker: GatedBroker
    loop: WorkerLoop
    state: WorkerState
    calls: list[list[int]] = field(default_factory=list)
    settling: threading.Event = field(default_factory=threading.Event)  # waits on a report
    on_call: Callable[[], None] = lambda: None  # runs in each handler call

    def status(self, task_id: str) -> str:
        value = self.r.hget(keys.job(task_id), "status")
        return value.decode() if isinstance(value, bytes) else str(value)


@pytest.fixture
def settings(redis_url: str) -> Settings:
    return make_settings(redis_url, report_overlap=ReportOverlap.ALWAYS)


@pytest.fixture
def pool(r: redis.Redis, settings: Settings) -> Iterator[Pool]:
    registry = Registry()
    calls: list[list[int]] = []

    @registry.task(TYPE, batch=Batch(max_size=SIZE, max_wait_ms=0))
    def handler(batch: list[Args], ctxs: list[TaskContext]) -> list[Any]:
        calls.append([args.value for args in batch])
        parts.on_call()
        return [{"value": args.value} for args in batch]

    broker = GatedBroker(r, settings, NAME, settings.class_names)
    state = WorkerState(NAME, None, settings.class_names, [TYPE])
    assert broker.register(state.info(), {}) is not None
    runner = Runner(registry, Interrupts(), lambda *_: None, {}, NAME, 1 << 20)
    loop = WorkerLoop(broker, runner, state, Recorder(), settings)
    assert loop.in_flight is not None
    parts = Pool(r, broker, loop, state, calls)
    settle = loop.in_flight.settle

    def observed_settle() -> Settled | None:
        if loop.in_flight is not None and loop.in_flight.busy:
            parts.settling.set()
        return settle()

    loop.in_flight.settle = observed_settle  # type: ignore[method-assign]
    yield parts
    broker.gate.set()


def _submit(r: redis.Redis, settings: Settings, n: int) -> list[str]:
    scripts = SyncScripts(r)
    return [submit(scripts, task_type=TYPE, settings=settings, args={"value": k}) for k in range(n)]


def _run(pool: Pool, control: Callable[[], None]) -> list[str]:
    """Run the loop on this thread while ``control`` runs on another; what ``control``
    failed with (its assertion messages), once the loop returned. The loop is stopped
    when ``control`` returns or fails."""
    failures: list[str] = []

    def controller() -> None:
        try:
            control()
        except Exception as exc:  # reported by the test, on the main thread
            failures.append(f"{type(exc).__name__}: {exc}")
        finally:
            pool.broker.gate.set()
            pool.state.request_stop()

    thread = threading.Thread(target=controller, daemon=True)
    thread.start()
    pool.loop.run()
    thread.join(30)
    assert not thread.is_alive()
    return failures


def test_the_next_batch_runs_while_the_last_report_is_in_flight(
    pool: Pool, settings: Settings
) -> None:
    ids = _submit(pool.r, settings, 3 * SIZE)
    seen: dict[str, Any] = {}
    pool.broker.gate.clear()  # the first report is held

    def control() -> None:
        # The second batch ran, and the loop waits for the first report before it
        # sends the second: one in flight at most.
        wait_for(lambda: len(pool.calls) == 2 and pool.settling.is_set(), 10,
                 what="a second batch, then the loop waiting on the first report")  # fmt: skip
        seen["calls"] = [list(c) for c in pool.calls]
        seen["first"] = [pool.status(t) for t in ids[:SIZE]]
        seen["sent"] = pool.broker.sent
        pool.broker.gate.set()
        wait_for(lambda: all(pool.status(t) == "finished" for t in ids), 10, "every task")

    assert _run(pool, control) == []
    assert seen["calls"] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # the third waited
    assert seen["first"] == ["started"] * SIZE  # ran, its report held
    assert seen["sent"] == 1
    assert sorted(v for call in pool.calls for v in call) == list(range(3 * SIZE))  # each once
    assert pool.broker.sent == 3  # every batch reported in the background
    for cls in settings.class_names:
        assert pool.r.llen(keys.inflight(NAME, cls)) == 0


def test_a_stopping_worker_reports_what_it_ran_before_it_returns(
    pool: Pool, settings: Settings
) -> None:
    ids = _submit(pool.r, settings, 2 * SIZE)
    pool.broker.gate.clear()
    assert pool.loop.in_flight is not None
    send = pool.loop.in_flight.send

    def send_then_stop(runs: list[Concluded], batch_items: int) -> None:
        send(runs, batch_items)  # then told to stop, with the report in flight
        pool.state.request_stop()

    pool.loop.in_flight.send = send_then_stop  # type: ignore[method-assign]

    def control() -> None:
        wait_for(pool.settling.is_set, 10, what="the stopping loop to wait for the report")

    assert _run(pool, control) == []
    assert pool.calls == [[0, 1, 2, 3]]
    assert [pool.status(t) for t in ids] == ["finished"] * SIZE + ["queued"] * SIZE
    for cls in settings.class_names:
        assert pool.r.llen(keys.inflight(NAME, cls)) == 0
    assert not pool.loop.in_flight.busy


def test_a_worker_goes_idle_once_its_last_report_landed(pool: Pool, settings: Settings) -> None:
    """Idle means nothing that ran is unreported: the API counts an idle worker as free."""
    ids = _submit(pool.r, settings, SIZE)
    pool.broker.gate.clear()
    seen: dict[str, Any] = {}

    def control() -> None:
        wait_for(pool.settling.is_set, 10, what="the loop, out of work, to wait for the report")
        seen["state"] = pool.state.state
        pool.broker.gate.set()
        wait_for(lambda: pool.state.state == "idle", 10, what="the worker to go idle")
        seen["statuses"] = [pool.status(t) for t in ids]

    assert _run(pool, control) == []
    assert seen == {"state": "busy", "statuses": ["finished"] * SIZE}


def test_a_claim_that_asks_for_redelivery_waits_for_the_report_in_flight(
    pool: Pool, settings: Settings
) -> None:
    """claim.lua redelivers what the worker holds ``started``: sent while a report is
    in flight, it would hand back a batch that ran, to run it twice. The claim that goes
    before the report is sent is lost here; the one asking for redelivery comes after."""
    ids = _submit(pool.r, settings, 2 * SIZE)
    pool.broker.gate.clear()
    seen: dict[str, Any] = {}

    def lose_the_next_claim() -> None:  # the claim after this batch: its reply is lost
        pool.broker.lose_claims = 1
        pool.on_call = lambda: None

    pool.on_call = lose_the_next_claim

    def control() -> None:
        wait_for(pool.settling.is_set, 10, what="the claim to wait for the report")
        seen["calls"] = len(pool.calls)
        pool.broker.gate.set()
        wait_for(lambda: all(pool.status(t) == "finished" for t in ids), 10, "every task")

    assert _run(pool, control) == []
    assert seen["calls"] == 1  # nothing claimed before the report landed
    assert pool.loop._redeliver is False
    assert sorted(v for call in pool.calls for v in call) == list(range(2 * SIZE))  # each once


def test_a_stop_that_comes_while_the_claim_waits_on_the_report_runs_nothing_more(
    pool: Pool, settings: Settings
) -> None:
    """Told to stop while its claim waited: what the claim took goes back to the head of
    its queue, unrun (a stopping or unhealthy worker takes no new work)."""
    ids = _submit(pool.r, settings, 2 * SIZE)
    pool.broker.gate.clear()

    def lose_the_next_claim() -> None:
        pool.broker.lose_claims = 1
        pool.on_call = lambda: None

    pool.on_call = lose_the_next_claim

    def control() -> None:
        wait_for(pool.settling.is_set, 10, what="the claim to wait for the report")
        pool.state.request_stop()
        pool.broker.gate.set()

    assert _run(pool, control) == []
    assert pool.calls == [[0, 1, 2, 3]]
    assert [pool.status(t) for t in ids] == ["finished"] * SIZE + ["queued"] * SIZE
    for cls in settings.class_names:
        assert pool.r.llen(keys.inflight(NAME, cls)) == 0


def test_a_batch_is_reported_when_the_claim_after_it_is_refused_for_good(
    pool: Pool, settings: Settings
) -> None:
    """The claim goes before the report is handed over: a script error there (which
    stops the worker) must not take the batch's outcomes with it."""
    ids = _submit(pool.r, settings, 2 * SIZE)

    def refuse_the_next_claim() -> None:
        pool.broker.refuse_claims = True

    pool.on_call = refuse_the_next_claim
    with pytest.raises(ResponseError):
        pool.loop.run()
    assert pool.calls == [[0, 1, 2, 3]]
    assert [pool.status(t) for t in ids] == ["finished"] * SIZE + ["queued"] * SIZE
    assert pool.state.stopping
    assert pool.loop.in_flight is not None and not pool.loop.in_flight.busy


@pytest.mark.parametrize(
    ("mode", "kind", "expected"),
    [
        (ReportOverlap.AUTO, "gpu", True),
        (ReportOverlap.AUTO, "cpu", False),
        (ReportOverlap.ALWAYS, "cpu", True),
        (ReportOverlap.NEVER, "gpu", False),
    ],
)
def test_auto_overlaps_on_a_gpu_only(
    redis_url: str, mode: ReportOverlap, kind: str, expected: bool
) -> None:
    from worker.gpu.devices import CPU, Device

    device = CPU if kind == "cpu" else Device(kind="gpu", index=0, uuid="GPU-1", name="card")
    state = WorkerState(NAME, device, ["batch"], [TYPE])
    assert overlaps(make_settings(redis_url, report_overlap=mode), state) is expected


def test_only_runs_that_ended_for_good_go_in_the_background() -> None:
    from worker.execute import Outcome, RunEnd

    claimed = Claimed("t1", "batch", b"", 1, 30.0, None, 0, None)
    done = Concluded(claimed, Outcome(RunEnd.FINISHED, result_json="1"), None)
    for status in (RunEnd.RELEASE, RunEnd.RETRY, RunEnd.LOST, RunEnd.ABANDON):
        assert not InFlight.takes([done, Concluded(claimed, Outcome(status), None)]), status
    assert InFlight.takes([done, Concluded(claimed, Outcome(RunEnd.FAILED), None)])
