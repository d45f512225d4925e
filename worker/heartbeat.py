"""The worker's second thread: lease renewal (the worker's and its GPU claim's),
device telemetry and health, metrics flush, cancel delivery, the reaper, and a
watchdog for tasks that neither finish nor stop.

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
from dispatcher.exits import EXIT_STUCK, EXIT_UNHEALTHY
from dispatcher.metrics import Recorder
from dispatcher.reaper import Reaped, record_reaped
from dispatcher.settings import Settings
from worker.broker import Broker, Claimed
from worker.execute import GpuFault, Interrupts, Runner, TaskHandback
from worker.sampler import DeviceWatch
from worker.state import WorkerState

__all__ = ["Heartbeat"]

log = logging.getLogger("gpulane.worker")

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
        self._fault_sent_at: float | None = None  # monotonic: GpuFault requested
        # Set by the main thread once it has a device: the NVML sampler, and the GPU
        # claim slot (uuid, slot) renewed with every beat.
        self.watch: DeviceWatch | None = None
        self.gpu_slot: tuple[str, int] | None = None

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if self.watch is not None:
            self.watch.stop()

    def _run(self) -> None:
        backoff = Backoff(cap_s=self.settings.heartbeat_interval_s)
        delay = 0.0
        while not self._stop.wait(delay):
            self.check_device()
            try:
                self.beat()
            except RedisError as exc:
                self._note_outage(exc)
                delay = backoff.next()
            except Exception:
                log.exception("heartbeat failed", extra={"worker": self.state.name})
                delay = self.settings.heartbeat_interval_s
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

    def beat(self, relist: bool = False) -> None:
        """One report. ``relist``: the worker was just unregistered on purpose."""
        if self.watch is not None:
            self.state.device_sample = self.watch.latest()
        # The reaper first: what it records leaves with this beat's metrics.
        record_reaped(self.broker.reap(), self.recorder, "gave back a dead worker's task")
        drained = self.recorder.drain()
        try:
            renewed, cancels = self.broker.heartbeat(self.state.info(), drained, RUN_TIME_TAU_S)
        except RedisError:
            self.recorder.restore(drained)
            raise
        if not renewed and not relist:
            log.warning(
                "lease had expired; worker re-registered", extra={"worker": self.state.name}
            )
        for task_id in cancels:  # first: the script already took them off the list
            log.info("cancel requested", extra={"worker": self.state.name, "task": task_id})
            self.runner.cancel(task_id)
        self._renew_gpu()

    def _renew_gpu(self) -> None:
        slot = self.gpu_slot
        if slot is None:
            return
        verdict = self.broker.gpu_renew(slot)
        if verdict == "retaken":
            log.warning("GPU claim had expired; taken again", extra={"worker": self.state.name})
        elif verdict != "held":
            # Another worker is pinned to our card now (we stalled past the lease): this
            # process cannot move to another card, so it leaves and a fresh one claims.
            self.gpu_slot = None
            self._unhealthy(f"its GPU claim {slot[0]} slot {slot[1]} was taken by {verdict}", False)

    def check_device(self) -> None:
        """Take the worker out of service when its device is lost or stopped answering."""
        problem = self.watch.problem() if self.watch is not None else None
        if problem is not None:
            self._unhealthy(problem, True)

    def _unhealthy(self, reason: str, device_failed: bool) -> None:
        if not self.state.mark_unhealthy(reason):
            return
        log.error(
            "worker unhealthy: %s; it takes no more tasks and exits to be restarted",
            reason,
            extra={"worker": self.state.name},
        )
        current = self.runner.current
        if device_failed and current is not None:
            self._fault_sent_at = time.monotonic()
            self.interrupts.request(GpuFault, current, reason)

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
            self.interrupts.request(TaskHandback, current)
        fault_at = self._fault_sent_at
        if fault_at is not None and time.monotonic() - fault_at > self.settings.timeout_grace_s:
            self._abandon_device(current.claimed)
        overdue_s = time.monotonic() - current.started_mono - claimed.timeout_s
        if overdue_s > self.settings.timeout_grace_s:
            self._give_up(claimed.task_id, overdue_s)

    def _abandon_device(self, claimed: Claimed) -> None:
        """The handler did not return after its device failed (blocked in the driver):
        hand its task back as a lost attempt from here and end the process."""
        log.error(
            "task did not stop after its device failed; handing it back and exiting",
            extra={"worker": self.state.name, "task": claimed.task_id},
        )
        fault = {"code": "gpu_fault", "message": self.state.reason}
        try:
            verdict = self.broker.release(claimed, at_head=True, fault=fault)
            done = [Reaped(claimed.task_id, claimed.cls, self._type(), verdict)]
            record_reaped(done, self.recorder, "task handed back after a GPU fault", "gpu_fault")
        except RedisError:
            log.exception("could not hand the task back; its lease will")
        self._exit(EXIT_UNHEALTHY)

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
            verdict, _ = self.broker.finish(current.claimed, "failed", error=error)
            if verdict == "ok":
                self.recorder.count("finished", current.claimed.cls, self._type(), "failed")
        except RedisError:
            log.exception("could not report the stuck task; its lease will hand it back")
        self._exit(EXIT_STUCK)

    def _type(self) -> str:
        current = self.runner.current
        return current.task_type if current is not None else "-"

    def _exit(self, status: int) -> None:
        """End the process from this thread (the main one is stuck): flush the metrics
        first, since nothing else will."""
        try:
            self.beat()
        except RedisError:
            log.warning("exiting without flushing the last metrics (redis unreachable)")
        os._exit(status)
