"""The worker's second thread: lease renewal, metrics flush, cancel delivery, the
reaper, and a watchdog for tasks that neither finish nor stop.

It never touches the task itself except through :class:`worker.execute.Interrupts`,
and it keeps beating while a handler runs, so a busy worker is never taken for dead
(plain RQ's SimpleWorker sends nothing while a job runs).
"""

from __future__ import annotations

import logging
import os
import threading
import time

from redis.exceptions import RedisError

from dispatcher.backoff import Backoff
from dispatcher.metrics import Recorder
from dispatcher.settings import Settings
from worker.broker import Broker
from worker.devices import telemetry
from worker.execute import Interrupts, Runner, TaskHandback
from worker.registry import TaskCanceled
from worker.state import WorkerState

__all__ = ["EXIT_STUCK", "Heartbeat"]

log = logging.getLogger("gpulane.worker")

EXIT_STUCK = 70  # the supervisor restarts us; the task was already reported
RUN_TIME_TAU_S = 20.0  # time constant of the run-time mean behind wait estimates


class Heartbeat:
    def __init__(
        self,
        broker: Broker,
        state: WorkerState,
        recorder: Recorder,
        runner: Runner,
        interrupts: Interrupts,
        settings: Settings,
    ) -> None:
        self.broker = broker
        self.state = state
        self.recorder = recorder
        self.runner = runner
        self.interrupts = interrupts
        self.settings = settings
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._handback_sent = False
        self._outage_since: float | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        backoff = Backoff(cap_s=self.settings.heartbeat_interval_s)
        delay = 0.0
        while not self._stop.wait(delay):
            try:
                self.beat()
            except RedisError as exc:
                self._note_outage(exc)
                delay = backoff.next()
            else:
                if self._outage_since is not None:
                    log.info("redis is back", extra={"worker": self.state.name})
                    self._outage_since = None
                backoff.reset()
                delay = self.settings.heartbeat_interval_s
            self.watchdog()

    def _note_outage(self, exc: RedisError) -> None:
        if self._outage_since is None:
            self._outage_since = time.monotonic()
            log.warning("redis unreachable: %s", exc, extra={"worker": self.state.name})

    def beat(self) -> None:
        self.state.device_sample = telemetry(self.state.device)
        drained = self.recorder.drain()
        try:
            renewed, cancels = self.broker.heartbeat(self.state.info(), drained, RUN_TIME_TAU_S)
        except RedisError:
            self.recorder.restore(drained)
            raise
        if not renewed:
            log.warning(
                "lease had expired; worker re-registered", extra={"worker": self.state.name}
            )
        for task_id in cancels:
            self.cancel(task_id)
        for reaped in self.broker.reap():
            self.recorder.count("requeued", reaped.cls, "worker_lost")
            log.warning(
                "gave back a dead worker's task: %s",
                reaped.outcome,
                extra={"task": reaped.task_id, "class": reaped.cls},
            )

    def cancel(self, task_id: str) -> None:
        current = self.runner.current
        if current is not None and current.task_id == task_id:
            log.info("cancel requested", extra={"worker": self.state.name, "task": task_id})
            current.request_cancel()
            self.interrupts.request(TaskCanceled)

    def watchdog(self) -> None:
        current = self.runner.current
        if current is None:
            return
        claimed = current.claimed
        stop_at = self.state.stop_requested_at
        if (
            stop_at is not None
            and not self._handback_sent
            and time.monotonic() - stop_at > self.settings.shutdown_grace_s
        ):
            self._handback_sent = True
            log.warning(
                "shutdown grace over; handing the task back", extra={"task": claimed.task_id}
            )
            self.interrupts.request(TaskHandback)
        overdue_s = time.time() - claimed.started_ms / 1000 - claimed.timeout_s
        if overdue_s > self.settings.timeout_grace_s:
            self._give_up(claimed.task_id, overdue_s)

    def _give_up(self, task_id: str, overdue_s: float) -> None:
        """The handler ignored its timeout (stuck in native code): report the task as
        timed out and end the process; the supervisor starts a fresh one."""
        current = self.runner.current
        if current is None:
            return
        log.error(
            "task ignored its timeout for %.0f s; restarting the worker",
            overdue_s,
            extra={"worker": self.state.name, "task": task_id},
        )
        error = {
            "code": "timeout",
            "message": f"Ran past its timeout of {current.claimed.timeout_s:g} s and did not "
            "stop; its worker was restarted.",
        }
        try:
            self.broker.finish(current.claimed, "failed", error=error)
        except RedisError:
            log.exception("could not report the stuck task; its lease will hand it back")
        os._exit(EXIT_STUCK)
