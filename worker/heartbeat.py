"""The worker's second thread: lease renewal (the worker's and its GPU claim's),
device telemetry and health, metrics flush, cancel delivery and the reaper; after
every beat it runs the :mod:`worker.watchdog` for tasks that neither finish nor stop.

It never touches the task itself except through :class:`worker.execute.Interrupts`,
and it keeps beating while a handler runs, so a busy worker is never taken for dead
(plain RQ's SimpleWorker sends nothing while a job runs).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass

from redis.exceptions import OutOfMemoryError, RedisError

from dispatcher.contract.backoff import Backoff
from dispatcher.contract.metrics import Drained, Recorder
from dispatcher.contract.reap import Reaped, record_reaped
from dispatcher.contract.settings import Settings
from dispatcher.contract.workers import RqCurrent
from worker.broker import Broker
from worker.execute import GpuFault, Interrupts, LeaseLost, RunControl, RunningTask
from worker.gpu.sampler import DeviceWatch
from worker.probe import write_health
from worker.state import WorkerState
from worker.watchdog import Watchdog

__all__ = ["Heartbeat"]

log = logging.getLogger("gpulane.worker")

RUN_TIME_TAU_S = 20.0  # time constant of the run-time mean behind wait estimates


@dataclass(frozen=True)
class Unanswered:
    """A beat as sent: what it folds and acks goes again, unchanged, until answered."""

    seq: str
    drained: Drained
    ack: tuple[str, ...]


class Heartbeat:
    def __init__(
        self,
        broker: Broker,
        state: WorkerState,
        recorder: Recorder,
        runner: RunControl,
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
        self._outage_since: float | None = None
        self.watchdog = Watchdog(broker, state, recorder, runner, interrupts, settings, self.beat)
        # Set by the main thread once it has a device: the NVML sampler, and the GPU
        # claim slot (uuid, slot) renewed with every beat.
        self.watch: DeviceWatch | None = None
        self.gpu_slot: tuple[str, int] | None = None
        self._lock = threading.Lock()
        self._token = uuid.uuid4().hex[:12]  # this process' beats, named token:n
        self._sent = 0
        self._unanswered: Unanswered | None = None  # sent, no reply yet: goes again
        self._acked: tuple[str, ...] = ()  # cancels the last answered beat returned

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
            self._write_health()
            self.watchdog.check()

    def _write_health(self) -> None:
        """The file Kubernetes' exec probes read (``python -m worker.probe``). Written on
        every pass, Redis or not: a Redis outage must not restart every worker."""
        path = self.settings.health_file
        if path is None:
            return
        state = self.state.state
        ready = state in ("idle", "busy") and self._outage_since is None
        try:
            write_health(path, state, ready, self.state.name)
        except OSError as exc:
            log.warning("cannot write the health file %s: %s", path, exc)

    def _note_outage(self, exc: RedisError) -> None:
        if self._outage_since is None:
            self._outage_since = time.monotonic()
            log.warning("redis unreachable: %s", exc, extra={"worker": self.state.name})

    def beat(self, relist: bool = False) -> None:
        """One report, one round trip (reaper, lease, GPU claim). ``relist``: the worker
        was just unregistered on purpose. A beat whose reply was lost goes first, as it
        was (its folds and acks apply once: heartbeat.lua), then a new one, so a last
        beat before an exit still carries every metric."""
        with self._lock:  # the heartbeat thread, and the main thread's last beat
            if self._unanswered is not None:
                self._send(self._unanswered, relist)
            self._sent += 1
            self._unanswered = Unanswered(
                f"{self._token}:{self._sent}", self.recorder.drain(), self._acked
            )
            self._send(self._unanswered, relist)

    def _send(self, beat_of: Unanswered, relist: bool) -> None:
        """Send one beat; it stays unanswered (to go again) unless its reply came and
        its heartbeat script ran."""
        if self.watch is not None:
            self.state.device_sample = self.watch.latest()
        current = self.runner.current
        running = current.claimed if current is not None else None
        beat = self.broker.beat(
            self.state.info(),
            self._rq_current(current),
            beat_of.drained,
            RUN_TIME_TAU_S,
            running,
            self.gpu_slot,
            seq=beat_of.seq,
            ack=beat_of.ack,
        )
        self._reaped(beat.reaped)  # it ran whatever became of the lease renewal
        if isinstance(beat.lease, RedisError):
            raise beat.lease  # refused whole: nothing folded, it goes again
        self._unanswered = None
        self._acked = tuple(beat.lease.cancels)  # the next beat takes them off the list
        if not beat.lease.renewed and not relist:
            log.warning(
                "lease had expired; worker re-registered", extra={"worker": self.state.name}
            )
        if current is not None and not beat.lease.held:
            self._stale_run(current)
        for task_id in beat.lease.cancels:  # sent until acked: a repeat finds it canceled
            log.info("cancel requested", extra={"worker": self.state.name, "task": task_id})
            self.runner.cancel(task_id)
        self._gpu_renewed(beat.gpu)

    def _reaped(self, reaped: list[Reaped] | RedisError) -> None:
        """Count what the reaper pass gave back (it goes out with the next beat's
        metrics). Redis full refuses the pass whole (it may write), while the lease
        renewal in the same round trip is allowed: the pass waits for room."""
        if isinstance(reaped, OutOfMemoryError):
            log.warning("redis is full (maxmemory): reaper pass skipped")
        elif isinstance(reaped, RedisError):
            log.warning("reaper pass failed: %s", reaped, extra={"worker": self.state.name})
        else:
            record_reaped(reaped, self.recorder, "gave back a dead worker's task")

    @staticmethod
    def _rq_current(ctx: RunningTask | None) -> RqCurrent | None:
        """The task running now, for RQ's worker registry."""
        if ctx is None:
            return None
        return RqCurrent(ctx.task_id, ctx.attempt, ctx.claimed.started_ms)

    def _stale_run(self, current: RunningTask) -> None:
        """The running task is no longer ours (the lease was lost and the task given
        back, or it runs again elsewhere): stop the run; its report would be fenced.
        A run that just ended is not touched (requests name the run they are for)."""
        log.warning(
            "lease lost: the task was given back or runs elsewhere; stopping this run",
            extra={"worker": self.state.name, "task": current.task_id},
        )
        self.interrupts.request(LeaseLost, current)

    def _gpu_renewed(self, verdict: str | RedisError | None) -> None:
        slot = self.gpu_slot
        if slot is None or verdict is None:
            return
        if isinstance(verdict, RedisError):
            raise verdict  # an outage for the claim as for the lease: retried, backed off
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
            self.watchdog.device_fault_sent()
            self.interrupts.request(GpuFault, current, reason)
