"""The watchdog: what happens when a task neither finishes nor stops.

Checked by the heartbeat thread after every beat, because the main thread is the one
that may be stuck. Three cases, each ending in a defined state rather than a hang:

- shutdown grace over: the running task is interrupted with a hand-back;
- the device failed and the handler did not return within ``timeout_grace_s`` (blocked
  in the driver): the task is handed back as a lost attempt and the process exits
  ``EXIT_UNHEALTHY``;
- the task ran ``timeout_grace_s`` past its timeout (stuck in native code, where
  SIGALRM cannot reach it): it is reported ``timeout`` and the process exits
  ``EXIT_STUCK`` for the supervisor to start a fresh one.

Times are monotonic: the worker's own clock, never compared with Redis' (host clock
skew must not kill healthy tasks).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from redis.exceptions import RedisError

from dispatcher.contract.exits import EXIT_STUCK, EXIT_UNHEALTHY
from dispatcher.contract.jobs import ErrorCode
from dispatcher.contract.metrics import Recorder
from dispatcher.contract.settings import Settings
from worker.broker import Broker
from worker.claims import Claimed
from worker.execute import Interrupts, RunControl, TaskHandback
from worker.handback import hand_back
from worker.state import WorkerState

__all__ = ["Watchdog"]

log = logging.getLogger("gpulane.worker")


class Watchdog:
    def __init__(
        self,
        broker: Broker,
        state: WorkerState,
        recorder: Recorder,
        runner: RunControl,
        interrupts: Interrupts,
        settings: Settings,
        flush: Callable[[], None],
    ) -> None:
        self.broker = broker
        self.state = state
        self.recorder = recorder
        self.runner = runner
        self.interrupts = interrupts
        self.settings = settings
        self._flush = flush  # one last beat before an exit from this thread
        self._handback_sent = False
        self._fault_sent_at: float | None = None  # monotonic: GpuFault requested

    def device_fault_sent(self) -> None:
        """The running task was interrupted because its device failed."""
        self._fault_sent_at = time.monotonic()

    def check(self) -> None:
        current = self.runner.current
        if current is None:
            return
        claimed = current.claimed
        now = time.monotonic()
        stop_at = self.state.stop_requested_at
        grace_over = stop_at is not None and now - stop_at > self.settings.shutdown_grace_s
        if grace_over and not self._handback_sent:
            self._handback_sent = True
            log.warning(
                "shutdown grace over; handing the task back", extra={"task": claimed.task_id}
            )
            self.interrupts.request(TaskHandback, current)
        fault_at = self._fault_sent_at
        if fault_at is not None and now - fault_at > self.settings.timeout_grace_s:
            self._abandon_device(claimed, current.task_type)
        overdue_s = now - current.started_mono - claimed.timeout_s
        if overdue_s > self.settings.timeout_grace_s:
            self._give_up(claimed, current.task_type, overdue_s)

    def _abandon_device(self, claimed: Claimed, task_type: str) -> None:
        """The handler did not return after its device failed (blocked in the driver):
        hand its task back as a lost attempt from here and end the process."""
        log.error(
            "task did not stop after its device failed; handing it back and exiting",
            extra={"worker": self.state.name, "task": claimed.task_id},
        )
        fault = {"code": ErrorCode.GPU_FAULT, "message": self.state.reason}
        why = "task handed back after a GPU fault"
        try:
            hand_back(
                self.broker, self.recorder, claimed, task_type, at_head=True, fault=fault, why=why
            )
        except RedisError:
            log.exception("could not hand the task back; its lease will")
        self._exit(EXIT_UNHEALTHY)

    def _give_up(self, claimed: Claimed, task_type: str, overdue_s: float) -> None:
        """The handler ignored its timeout: report the task as timed out and end."""
        log.error(
            "task ignored its timeout for %.0f s; restarting the worker",
            overdue_s,
            extra={"worker": self.state.name, "task": claimed.task_id},
        )
        error = {
            "code": ErrorCode.TIMEOUT,
            "message": f"Ran past its timeout of {claimed.timeout_s:g} s and did not "
            "stop; its worker was restarted.",
        }
        try:
            verdict, _ = self.broker.finish(claimed, "failed", error=error)
            if verdict == "ok":
                self.recorder.count("finished", claimed.cls, task_type, "failed")
        except RedisError:
            log.exception("could not report the stuck task; its lease will hand it back")
        self._exit(EXIT_STUCK)

    def _exit(self, status: int) -> None:
        """End the process from this thread (the main one is stuck): flush the metrics
        first, since nothing else will."""
        try:
            self._flush()
        except RedisError:
            log.warning("exiting without flushing the last metrics (redis unreachable)")
        os._exit(status)
