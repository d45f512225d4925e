"""The worker's task loop: claim, run, report; park on the doorbell when idle.

Pulling is what balances the pool: a worker asks for the next task only when it is
free, so no router has to guess which GPU is idle.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time

from redis.exceptions import RedisError

from dispatcher.contract.backoff import Backoff
from dispatcher.contract.connect import REFUSED_FOR_NOW, refused, why_refused
from dispatcher.contract.jobs import PUBLIC_STATUS
from dispatcher.contract.metrics import Recorder
from dispatcher.contract.settings import Settings
from worker import tasklog
from worker.batching import BatchRunner, batch_policies
from worker.broker import Broker
from worker.claims import Claimed
from worker.execute import Outcome, RunEnd, Runner
from worker.gpu.budget import GpuBudget
from worker.memory import rss_bytes
from worker.overlap import InFlight, overlaps
from worker.report import Concluded, Reporter, wait_out
from worker.state import WorkerState

__all__ = ["WorkerLoop"]

log = logging.getLogger("gpulane.worker")

PARK_POLL_S = 1.0  # how often a parked worker looks up to check for a stop request
RECHECK_S = 5.0  # a parked worker looks at the queues anyway this often (lost doorbells)


class WorkerLoop:
    def __init__(
        self,
        broker: Broker,
        runner: Runner,
        state: WorkerState,
        recorder: Recorder,
        settings: Settings,
        gpu: GpuBudget | None = None,
    ) -> None:
        self.broker = broker
        self.runner = runner
        self.state = state
        self.recorder = recorder
        self.settings = settings
        self._backoff = Backoff()
        self.reporter = Reporter(broker, recorder, state, settings, self._backoff)
        self.batches = batch_policies(runner.registry, settings)
        self._batch_sizes = {t: b.max_size for t, b in self.batches.items() if b.max_size > 1}
        self._batch_runner = BatchRunner(runner, {t: b.max_size for t, b in self.batches.items()})
        self._redeliver = False  # a claim's reply was lost: ask for what it took
        self._device = json.dumps(self.runner.device)  # recorded on each task it starts
        self.gpu = gpu or GpuBudget(None)  # the card's memory, for placement
        # The last batch's report, in flight while the next one runs (worker/overlap.py).
        self.in_flight = InFlight.for_worker(self.reporter) if overlaps(settings, state) else None
        if self.in_flight is not None:
            log.info("reports each batch while the next one runs", extra=self._who)

    def run(self) -> None:
        try:
            claims = self._serve()
        except BaseException:
            self.state.request_stop()  # a report in flight gives up past the grace period
            raise
        finally:
            self._settle()  # a worker that exits has reported what it ran
            if self.in_flight is not None:
                self.in_flight.close()
        if claims:  # taken as the worker was told to stop: back to the head of their queue
            self.reporter.report([Concluded(c, Outcome(RunEnd.RELEASE), None) for c in claims])
        self._unpark()

    def _serve(self) -> list[Claimed] | None:
        """Claim, run, report until told to stop; what the last claim took and nothing
        ran (to hand back), if anything."""
        was_idle = True  # a fresh worker may sit in idle sets from an earlier life
        claims: list[Claimed] | None = None  # taken with the last report, if any
        while not self.state.stopping:
            if claims is None:
                claims = self._claim(was_idle)
                if claims is None:
                    continue  # waited out a refusal or an outage
            if not claims:
                was_idle = True
                self._settle()  # idle means nothing ran is left unreported
                self.state.set("idle")
                self._park()
                claims = None
                continue
            if self.state.stopping:
                break  # told to stop while the claim went (or waited on a report)
            was_idle = False
            if self.settings.fault_point == "after_claim":
                os.kill(os.getpid(), signal.SIGKILL)  # tests: die between dequeue and start
            claims = self._execute(claims)
        return claims

    def _claim(self, was_idle: bool) -> list[Claimed] | None:
        """The next claim's tasks (empty: none, the worker is parked), or None after
        waiting out a refusal or an outage."""
        if self._redeliver:
            self._settle()  # claim.lua redelivers what we hold unreported, too
        try:
            claims = self.broker.claim(
                was_idle,
                self._device,
                self._redeliver,
                self._batch_sizes,
                self.gpu.available_mb(),
            )
        except REFUSED_FOR_NOW as exc:
            # Refused whole before it ran (script flags): nothing moved. Wait for
            # room, saying why in GET /workers; the heartbeat keeps the lease.
            self.state.set("idle", f"{why_refused(exc)}; takes no task until it can write")
            self._wait_out(exc)
            return None
        except RedisError as exc:
            if refused(exc):
                raise  # a script error, not an outage: retrying would loop forever
            self._redeliver = True  # the claim may have run and only its reply was lost
            self._wait_out(exc)
            return None
        self._redeliver = False
        self._backoff.reset()
        return claims

    def _fill(self, claims: list[Claimed], task_type: str) -> list[Claimed]:
        """A short batch waits up to its max_wait_ms for more tasks of its type, and not
        at all while a higher class has work (claim.lua says when to stop)."""
        policy = self.batches[task_type]
        deadline = time.monotonic() + policy.max_wait_ms / 1000
        poll_s = max(policy.max_wait_ms / 5000, 0.0005)
        free_mb = self.gpu.available_mb()  # nothing runs while it waits: read it once
        while _items(claims) < policy.max_size and time.monotonic() < deadline:
            try:
                stop, more = self.broker.claim_more(
                    claims[0].cls,
                    task_type,
                    policy.max_size - _items(claims),
                    self._device,
                    free_mb,
                )
            except RedisError:
                self._redeliver = True  # what it took (if anything) comes with the next claim
                break
            claims = claims + more
            if stop or self.state.stopping:
                break
            time.sleep(max(min(poll_s, deadline - time.monotonic()), 0))
        return claims

    def _execute(self, claims: list[Claimed]) -> list[Claimed] | None:
        """Run what one claim took (a task is a batch of one) and report it; returns
        what the claim sent with the report took (None: claim anew)."""
        task_type = claims[0].task_type  # from claim.lua: no decode to route it
        policy = self.batches.get(task_type)
        if policy is not None and _items(claims) < policy.max_size:
            claims = self._fill(claims, task_type)
        self.state.set("busy")
        tasklog.batch_started(self.broker.name, claims, task_type, policy is not None)
        if policy is not None:
            self.recorder.observe("batch_size", _items(claims), task_type)
        items = self._batch_runner.run(claims)
        runs = []
        for item in items:
            assert item.outcome is not None
            runs.append(Concluded(item.claimed, item.outcome, item.ctx, item.device_s))
        return self._conclude(runs, _items(claims))

    def _unpark(self) -> None:
        try:
            self.broker.unpark()
        except RedisError as exc:
            log.warning("could not leave the idle sets (%s); the lease will", exc)

    def _park(self) -> None:
        deadline = time.monotonic() + RECHECK_S
        while not self.state.stopping and time.monotonic() < deadline:
            try:
                if self.broker.wait_for_work(PARK_POLL_S):
                    return
            except RedisError as exc:
                self._wait_out(exc)
                return

    def _wait_out(self, exc: RedisError) -> None:
        wait_out(self._backoff, exc, self.broker.name)

    def _conclude(self, runs: list[Concluded], batch_items: int = 1) -> list[Claimed] | None:
        """Report the outcomes (a batch's in one round trip) with the next claim when
        the worker goes on serving, log and count each. ``batch_items``: the items the
        batch's calls ran (what their time is shared by, for the per-item run time
        admission estimates with). Returns what that claim took (None: claim anew)."""
        for run in runs:
            self._check_lost(run.outcome)  # before the report
        over_memory = self._over_memory()  # read once: nothing runs before the report
        self._settle()  # one report in flight at most, and in order
        if (
            self.in_flight is not None
            and over_memory is None
            and not self.state.stopping
            and self.in_flight.takes(runs)
        ):
            # The device's next batch first, then the report, so that neither the
            # claim's round trip nor Redis' time for it waits behind the results.
            try:
                claims = self._claim(False)
            finally:  # sent whatever the claim met: a script error stops the worker
                self.in_flight.send(runs, batch_items)
            return claims  # None: waited out a refusal or an outage; claim again
        ended = self.reporter.report(runs, None if over_memory else self._next_claim())
        if self.reporter.claim_lost:
            self._redeliver = True
        self._reported(runs, ended, batch_items)
        if over_memory:  # after the report: the outcomes are recorded first
            log.warning("%s after a task; exiting to be restarted", over_memory, extra=self._who)
            self.state.recycle(over_memory)
        return self.reporter.claimed

    def _settle(self) -> None:
        """Wait for the report in flight, if any, and do its bookkeeping."""
        settled = self.in_flight.settle() if self.in_flight is not None else None
        if settled is not None:
            self._reported(settled.runs, settled.ended, settled.batch_items)

    def _reported(self, runs: list[Concluded], ended: list[int | None], batch_items: int) -> None:
        """Log and count each reported run; ``ended``: when each was recorded (Redis'
        clock), None when not recorded here."""
        lines = []
        for run, ended_ms in zip(runs, ended, strict=True):
            claimed, outcome = run.claimed, run.outcome
            task_type = run.ctx.task_type if run.ctx else "-"
            # Usage counts every run's device time, handed back or not: the card was busy.
            self.recorder.use(claimed.tenant, claimed.cls, task_type, run.device_s)
            status = PUBLIC_STATUS.get(outcome.status, outcome.status)
            if ended_ms is not None:  # Redis' clock, as the record says
                run_s = (ended_ms - claimed.started_ms) / 1000
            else:  # handed back or abandoned: how long it ran here
                run_s = time.monotonic() - run.ctx.started_mono if run.ctx else 0.0
            error = outcome.error["code"] if outcome.error else None
            lines.append(tasklog.Ended(claimed, task_type, status, run_s, error))
            if outcome.split is not None:  # its parts are counted as submitted by split.lua
                self.state.ended(True)
            elif ended_ms is not None:
                self._record(claimed, task_type, status, ended_ms, batch_items)
        tasklog.ended(self.broker.name, lines)

    def _next_claim(self) -> str | None:
        """The claim to send with the report (one round trip per task, not two), or
        None while the worker is about to stop (told to, or unhealthy)."""
        if self.state.stopping:
            return None
        return self.broker.claim_options(
            False, self._device, self._redeliver, self._batch_sizes, self.gpu.available_mb()
        )

    def _check_lost(self, outcome: Outcome) -> None:
        """A GPU fault takes the worker out of service before the report: no task may be
        claimed on a broken CUDA context."""
        if (
            outcome.status == RunEnd.LOST
            and outcome.error
            and self.state.mark_unhealthy(outcome.error["message"])
        ):
            log.error(
                "worker unhealthy: %s; it takes no more tasks and exits to be restarted",
                outcome.error["message"],
                extra={"worker": self.broker.name},
            )

    def _over_memory(self) -> str | None:
        """Why the worker must exit to be restarted after this task (past
        max_worker_rss_mb: it gives back whatever the task left allocated), or None."""
        limit = self.settings.max_worker_rss_mb
        if limit is None:
            return None
        rss_mb = rss_bytes() // (1024 * 1024)
        if rss_mb <= limit:
            return None
        return f"resident memory {rss_mb} MB is above max_worker_rss_mb {limit} MB"

    @property
    def _who(self) -> dict[str, str]:
        return {"worker": self.broker.name}

    def _record(
        self, claimed: Claimed, task_type: str, status: str, ended_ms: int, batch_items: int
    ) -> None:
        self.state.ended(status == "succeeded")
        run_s = (ended_ms - claimed.started_ms) / 1000
        self.recorder.count("finished", claimed.cls, task_type, status, n=claimed.items)
        self.recorder.observe("run", run_s, claimed.cls, task_type)
        if claimed.created_ms is not None:
            self.recorder.observe(
                "queue_wait", (claimed.started_ms - claimed.created_ms) / 1000, claimed.cls
            )
            self.recorder.observe("latency", (ended_ms - claimed.created_ms) / 1000, claimed.cls)
        if status in ("succeeded", "failed"):
            # One sample per item, each the batch's time shared by its items: the pool's
            # run time is per item, what admission multiplies by the items queued.
            self.recorder.run_sample(claimed.cls, run_s / batch_items, claimed.items)


def _items(claims: list[Claimed]) -> int:
    """Items the claimed records hold (a task is one, a chunk its ``items``)."""
    return sum(c.items for c in claims)
