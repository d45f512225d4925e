"""A backend worker's loop: claim while a slot is free, relay each task, report it.

Pull stays least-busy: the worker claims only while it has a free slot, so a server
of half the speed frees its slots, and so takes work, half as often. One claimer at a
time: when a claim finds nothing the worker parks (claim.lua puts it in its types'
idle sets) and waits on its doorbell; any claim that took a task is followed by
another while slots are free, so one doorbell fills every free slot.

Health: a probe every ``backend_probe_interval_s`` (and at once when a run finds the
connection broken). A server that does not answer takes the worker out of claiming
(state ``backend_down``, out of the idle sets) and stops its runs: those that sent
nothing yet go back to the queue for another backend, started streams end with an
error entry. Claiming resumes by itself when the server answers again.

Redis calls go through the synchronous :class:`worker.broker.Broker` on threads: the
same scripts, fencing and outage handling as an in-process worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time

from redis.exceptions import RedisError

from dispatcher.contract.backoff import Backoff
from dispatcher.contract.connect import REFUSED_FOR_NOW, async_client, refused, why_refused
from dispatcher.contract.jobs import PUBLIC_STATUS, ErrorCode
from dispatcher.contract.metrics import Recorder
from dispatcher.contract.settings import Settings
from worker.backend.client import Backend
from worker.backend.relay import Relay, Stop
from worker.backend.stream import StreamAppends, StreamWriter
from worker.broker import Broker
from worker.claims import Claimed
from worker.execute import RECORDED, Outcome, RunEnd, RunningTask
from worker.report import Concluded, Reporter
from worker.state import WorkerState

__all__ = ["BackendLoop"]

log = logging.getLogger("gpulane.worker")

PARK_POLL_S = 1.0  # a parked worker looks up this often (a stop, a freed slot)
RECHECK_S = 5.0  # and at the queues anyway (lost doorbells)


class BackendLoop:
    def __init__(
        self,
        broker: Broker,
        backend: Backend,
        state: WorkerState,
        recorder: Recorder,
        settings: Settings,
        slots: int,
    ) -> None:
        self.broker = broker
        self.backend = backend
        self.state = state
        self.recorder = recorder
        self.settings = settings
        self.slots = slots
        self.current: RunningTask | None = None  # RunControl: no run is driven by interrupts
        self._runs: dict[str, tuple[asyncio.Task[None], Relay]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._down: str | None = None  # why the server is taken to be down
        self._probe_now = asyncio.Event()
        self._changed = asyncio.Event()  # a slot freed, or the server's health changed
        self._backoff = Backoff()
        self._lock = threading.Lock()  # the heartbeat thread reads the runs
        # Recorded on each task it starts, as an in-process worker records its device.
        self._device = json.dumps({"kind": "backend", "url": backend.url})

    # RunControl, from the heartbeat thread.
    def cancel(self, task_id: str) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._stop_run, task_id, Stop.CANCEL)

    def _stop_run(self, task_id: str, why: Stop) -> None:
        run = self._runs.get(task_id)
        if run is not None and run[1].stop is None:
            run[1].stop = why
            if run[1].running:  # else it sees `stop` as it starts (a task canceled before
                run[0].cancel()  # its first step never runs a line of it)

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        client = async_client(self.settings, socket_timeout=10, connect_timeout=5)
        self._appends = StreamAppends(client, self.broker)
        self._publish()
        prober = asyncio.create_task(self._probe())
        try:
            await self._claim_loop()
            await self._drain()
        finally:
            prober.cancel()
            await asyncio.gather(prober, return_exceptions=True)
            await asyncio.to_thread(self._unpark)
            await client.aclose()

    async def _claim_loop(self) -> None:
        was_idle = True
        while not self.state.stopping:
            if self._down is not None or len(self._runs) >= self.slots:
                # Until a slot frees or the server comes back (a stop is looked at
                # each PARK_POLL_S): no polling delay between a run's end and a claim.
                self._changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), PARK_POLL_S)
                continue
            claims = await self._claim(was_idle)
            if claims == []:  # nothing queued: parked until a doorbell's claim takes some
                was_idle = True
                claims = await self._park()
            if claims:
                was_idle = False
                for claimed in claims:
                    self._start(claimed)

    def _claim_now(
        self, was_idle: bool, doorbell_s: float | None, running: dict[str, int]
    ) -> list[Claimed] | None:
        """(On a thread.) One claim; with ``doorbell_s``, only once the doorbell rang
        within that long (None: it did not), in the same thread: a doorbell costs one
        hop to a thread, not two. A redelivery leaves out the attempts in ``running``:
        the other slots run them."""
        if doorbell_s is not None and not self.broker.wait_for_work(doorbell_s):
            return None
        return self.broker.claim(was_idle, self._device, self._redeliver, running=running)

    async def _claim(self, was_idle: bool, doorbell_s: float | None = None) -> list[Claimed] | None:
        """What one claim took (empty: nothing queued, the worker is parked); None when
        the doorbell did not ring, or after waiting out a refusal or an outage
        (``redeliver`` then asks for what a claim whose reply was lost took)."""
        try:
            running = (
                {task_id: relay.claimed.attempt for task_id, (_, relay) in self._runs.items()}
                if self._redeliver
                else {}
            )
            claims = await asyncio.to_thread(self._claim_now, was_idle, doorbell_s, running)
            if claims is None:
                return None
        except REFUSED_FOR_NOW as exc:
            self.state.set(
                self.state.state, f"{why_refused(exc)}; takes no task until it can write"
            )
            await asyncio.sleep(self._backoff.next())
            return None
        except RedisError as exc:
            if refused(exc):
                raise
            self._redeliver = True
            if self._backoff.failures == 0:
                log.warning("redis unavailable, retrying: %s", exc, extra=self._who)
            await asyncio.sleep(self._backoff.next())
            return None
        self._redeliver = False
        self._backoff.reset()
        return claims

    _redeliver = False

    async def _park(self) -> list[Claimed] | None:
        """Wait on the doorbell (a stop, the server going down or RECHECK_S end it);
        what the claim it rang took, or None."""
        self._publish()
        deadline = time.monotonic() + RECHECK_S
        while not self.state.stopping and self._down is None and time.monotonic() < deadline:
            claims = await self._claim(True, PARK_POLL_S)
            if claims is not None:
                return claims
        return None

    def _start(self, claimed: Claimed) -> None:
        writer = StreamWriter(
            lambda entries: self._appends.append(claimed, entries),
            claimed.task_id,
            lambda: self.broker.stream_length(claimed),
        )
        relay = Relay(claimed, self.backend, writer, self.recorder, self.backend.url)
        task = asyncio.create_task(self._serve(claimed, relay))
        with self._lock:
            self._runs[claimed.task_id] = (task, relay)
        log.info(
            "task started", extra={**self._who, "task": claimed.task_id, "attempt": claimed.attempt}
        )
        self._publish()

    async def _serve(self, claimed: Claimed, relay: Relay) -> None:
        try:
            try:
                outcome = await relay.run()
            except Exception as exc:  # a relay bug must not strand the task
                log.exception("relay failed", extra={**self._who, "task": claimed.task_id})
                outcome = Outcome.fail(ErrorCode.TASK_ERROR, f"{type(exc).__name__}: {exc}")
            finally:
                await relay.writer.close()
            if outcome.status == RunEnd.RELEASE and relay.stop is None:
                self._probe_now.set()  # the connection broke: is the server gone?
            await asyncio.to_thread(self._report, claimed, outcome, relay)
        finally:
            # Whatever happened, the slot is free again: a run left here would keep the
            # worker busy and its slot taken for good. Only this run's entry: a later
            # attempt of the same task may hold the id by now.
            with self._lock:
                if self._runs.get(claimed.task_id, (None, None))[1] is relay:
                    del self._runs[claimed.task_id]
            self._changed.set()
            self._publish()

    def _report(self, claimed: Claimed, outcome: Outcome, relay: Relay) -> None:
        """Record the outcome (on a thread: the Reporter waits out Redis outages), settle
        the tenant's token charge and count what the run used."""
        # A backend worker's device time is the slot's: from the claim to the outcome.
        slot_s = time.monotonic() - relay.started
        reporter = Reporter(self.broker, self.recorder, self.state, self.settings, Backoff())
        ended = reporter.report([Concluded(claimed, outcome, None, slot_s)])[0]
        self.recorder.use(claimed.tenant, claimed.cls, claimed.task_type, slot_s)
        status = PUBLIC_STATUS.get(outcome.status, outcome.status)
        elapsed = time.monotonic() - relay.started
        error = {"error": outcome.error["code"]} if outcome.error else {}
        log.info(
            "task %s",
            status,
            extra={
                **self._who,
                "task": claimed.task_id,
                "class": claimed.cls,
                "elapsed_s": round(elapsed, 3),
                **error,
            },
        )
        usage = relay.usage
        if usage is not None:
            model = relay.model.replace("|", "_")
            self.recorder.count("tokens", claimed.tenant or "-", model, "prompt", n=usage.prompt)
            self.recorder.count(
                "tokens", claimed.tenant or "-", model, "completion", n=usage.completion
            )
        if outcome.status in RECORDED:
            try:
                self.broker.settle_tokens(claimed, usage.prompt + usage.completion if usage else 0)
            except RedisError as exc:  # the charge refills with time anyway
                log.warning(
                    "tokens not settled: %s", exc, extra={**self._who, "task": claimed.task_id}
                )
        if ended is None:
            return
        self.state.ended(status == "succeeded")
        run_s = (ended - claimed.started_ms) / 1000
        self.recorder.count("finished", claimed.cls, claimed.task_type, status)
        self.recorder.observe("run", run_s, claimed.cls, claimed.task_type)
        if claimed.created_ms is not None:
            self.recorder.observe(
                "queue_wait", (claimed.started_ms - claimed.created_ms) / 1000, claimed.cls
            )
            self.recorder.observe("latency", (ended - claimed.created_ms) / 1000, claimed.cls)
        if status in ("succeeded", "failed"):
            # The worker counts once among the class's workers and runs `slots` tasks
            # at once: to admission each of its tasks takes a slot's share of the time.
            self.recorder.run_sample(claimed.cls, run_s / self.slots)

    async def _probe(self) -> None:
        interval = self.settings.backend_probe_interval_s
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._probe_now.wait(), interval)
            self._probe_now.clear()
            problem = await self.backend.probe()
            if problem is not None and self._down is None:
                await self._went_down(problem)
            elif problem is None and self._down is not None:
                log.info("backend %s answers again; claiming", self.backend.url, extra=self._who)
                self._down = None
                self._changed.set()
                self._publish()

    async def _went_down(self, problem: str) -> None:
        self._down = problem
        log.error(
            "backend %s does not answer (%s); claiming stops",
            self.backend.url,
            problem,
            extra=self._who,
        )
        self._publish()
        await asyncio.to_thread(self._unpark)  # no doorbell may ring for it meanwhile
        for task_id in list(self._runs):
            self._stop_run(task_id, Stop.BACKEND_DOWN)

    async def _drain(self) -> None:
        """After a stop: runs finish within the shutdown grace, then are stopped."""
        if not self._runs:
            return
        tasks = [task for task, _ in self._runs.values()]
        _, pending = await asyncio.wait(tasks, timeout=self.settings.shutdown_grace_s)
        if pending:
            log.warning(
                "%d tasks still running past the grace period; handing back",
                len(pending),
                extra=self._who,
            )
            for task_id in list(self._runs):
                self._stop_run(task_id, Stop.HANDBACK)
            await asyncio.wait(pending)

    def _unpark(self) -> None:
        try:
            self.broker.unpark()
        except RedisError as exc:
            log.warning("could not leave the idle sets (%s); the lease will", exc, extra=self._who)

    def _publish(self) -> None:
        """The state the heartbeat publishes: busy with any run, the slots in use."""
        busy = len(self._runs)
        if self._down is not None:
            self.state.set(
                "backend_down", f"backend {self.backend.url} does not answer: {self._down}"[:300]
            )
        else:
            self.state.set("busy" if busy else "idle")
        if self.state.backend is not None:
            self.state.backend = {**self.state.backend, "busy": busy}

    @property
    def _who(self) -> dict[str, str]:
        return {"worker": self.broker.name}
