"""Reporting outcomes: what a run ended with goes to Redis, whatever Redis is going
through. A finished task is never dropped: an outage, a full or read-only Redis or too
few replica acks are waited out (the heartbeat keeps the lease meanwhile). Only a
script error (retrying would repeat it) or a stop past the grace period gives up, and
then the lease hands the task to another worker (at-least-once).

A batch's results go in one round trip and one ``finish.lua`` call (per 64 records:
``Broker.finish_many``), not one per item: a batch of 64 would otherwise spend 64
round trips reporting, more than its GPU time when Redis is on another host, and 64
times the script's own cost in Redis. Hand-backs (shutdown, retry, GPU
fault: rare) still go one task at a time, last first, to keep their order.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from dispatcher.contract.backoff import Backoff
from dispatcher.contract.connect import REFUSED_FOR_NOW, ReplicaLag, refused, why_refused
from dispatcher.contract.metrics import Recorder
from dispatcher.contract.settings import Settings
from worker.broker import Broker
from worker.claims import Claimed, Report
from worker.execute import RECORDED, Outcome, RunEnd, RunningTask
from worker.handback import hand_back
from worker.state import WorkerState

__all__ = ["Concluded", "Reporter", "wait_out"]

log = logging.getLogger("gpulane.worker")


def wait_out(backoff: Backoff, exc: RedisError, worker: str) -> None:
    """Sleep the next backoff delay; say so once per outage."""
    delay = backoff.next()
    if backoff.failures == 1:
        log.warning("redis unavailable, retrying: %s", exc, extra={"worker": worker})
    time.sleep(delay)


@dataclass
class Concluded:
    """One run to report: the task, how it ended and its context (None when the call
    could not even be decoded)."""

    claimed: Claimed
    outcome: Outcome
    ctx: RunningTask | None
    device_s: float = 0.0  # device time the run used (its share of its batch's calls)


def _report(run: Concluded) -> Report:
    outcome, ctx = run.outcome, run.ctx
    progress = ctx.latest_progress if ctx else None
    return Report(
        run.claimed,
        outcome.status,
        outcome.result_json,
        outcome.error,
        progress,
        run.device_s,
        outcome.split,
        outcome.entries,
    )


class Reporter:
    """Hands outcomes to Redis, waiting out outages with the given backoff (the loop's;
    the background reporter of ``report_overlap`` has its own)."""

    def __init__(
        self,
        broker: Broker,
        recorder: Recorder,
        state: WorkerState,
        settings: Settings,
        backoff: Backoff,
    ) -> None:
        self.broker = broker
        self.recorder = recorder
        self.state = state
        self.settings = settings
        self.backoff = backoff
        self.claimed: list[Claimed] | None = None  # what the last report's claim took
        self.claim_lost = False  # that claim's reply was lost: ask with redeliver

    def report(self, runs: Sequence[Concluded], claim_opts: str | None = None) -> list[int | None]:
        """Record every run's outcome; per run, the Redis time it ended at, or None when
        not recorded here (handed back, abandoned, or recorded by someone else).

        ``claim_opts``: the worker's next claim, sent in the first report's round trip
        when every run ended for good; what it took is in :attr:`claimed` (None: no
        claim went, or its reply was lost and :attr:`claim_lost` says so)."""
        self.claimed = None
        self.claim_lost = False
        ended: list[int | None] = [None] * len(runs)
        pending = [k for k, run in enumerate(runs) if run.outcome.status in RECORDED]
        if len(pending) < len(runs):
            claim_opts = None  # hand-backs go after the reports, and before any claim
        while pending:
            once, claim_opts = claim_opts, None  # a claim goes once, sent again never
            try:
                self._finish(runs, pending, ended, once)
            except RedisError as exc:
                if self._gave_up(exc, [runs[k] for k in pending]):
                    break
            else:
                self.backoff.reset()
        # Last first: tasks handed back at the head of their queue keep their order.
        for run in reversed(runs):
            if run.outcome.status == RunEnd.ABANDON:
                log.warning(
                    "task abandoned: its lease was lost; not reported",
                    extra={"worker": self.broker.name, "task": run.claimed.task_id},
                )
                continue
            while run.outcome.status not in RECORDED:
                try:
                    self._hand_back(run)
                except RedisError as exc:
                    if self._gave_up(exc, [run]):
                        break
                else:
                    self.backoff.reset()
                    break
        return ended

    def _finish(
        self,
        runs: Sequence[Concluded],
        pending: list[int],
        ended: list[int | None],
        claim_opts: str | None,
    ) -> None:
        """One round trip for the runs still ``pending``. A recorded run leaves it; one
        Redis refused for good (a script error) is given up alone; the first error to
        wait out is raised once the others are recorded. Unconfirmed by the replicas
        (``ReplicaLag``): all stay pending to be sent again, keeping when they ended
        (the second answer is ``duplicate``)."""
        lag: ReplicaLag | None = None
        try:
            replies = self._send([_report(runs[k]) for k in pending], claim_opts)
        except ReplicaLag as exc:
            replies, lag = exc.replies, exc
        retry: RedisError | None = None
        for k, reply in zip(list(pending), replies, strict=False):
            if isinstance(reply, RedisError):
                if refused(reply):
                    self._give_up(runs[k], reply)
                    pending.remove(k)
                else:
                    retry = retry or reply
                continue
            verdict, ended_ms = reply
            if verdict == "ok":
                ended[k] = ended_ms
            elif ended[k] is None:
                log.info(
                    "outcome already recorded elsewhere (%s)",
                    verdict,
                    extra={"worker": self.broker.name, "task": runs[k].claimed.task_id},
                )
            if lag is None:
                pending.remove(k)
        if lag is not None:
            raise lag
        if retry is not None:
            raise retry

    def _send(self, reports: list[Report], claim_opts: str | None) -> list[Any]:
        """The reports' replies, in one round trip with the claim when there is one."""
        if claim_opts is None:
            return self.broker.finish_many(reports)
        self.claim_lost = True  # until its reply is read
        replies, claimed = self.broker.finish_and_claim(reports, claim_opts)
        if not isinstance(claimed, RedisError):
            self.claimed, self.claim_lost = claimed, False
        return replies

    def _give_up(self, run: Concluded, exc: RedisError) -> None:
        """A script error, not an outage: retrying would never end. Leave; the lease
        hands the task to another worker, within its attempt budget."""
        log.error(
            "redis refused the report: %s",
            exc,
            extra={"worker": self.broker.name, "task": run.claimed.task_id},
        )
        self.state.mark_unhealthy("redis refused a task report (a script error)")

    def _gave_up(self, exc: RedisError, runs: Sequence[Concluded]) -> bool:
        """After Redis refused a report of ``runs``: True to give them up (a script
        error; stopping past the grace period), else wait and False to send again."""
        if refused(exc):
            for run in runs:
                self._give_up(run, exc)
            return True
        if isinstance(exc, REFUSED_FOR_NOW):  # full or read-only: hold the outcome
            self.state.set("busy", f"{why_refused(exc)}; holding a task's outcome")
        return self._abandon(exc)

    def _hand_back(self, run: Concluded) -> None:
        """Give the task back: at the head (shutdown), at the tail (a retry), or after a
        GPU fault as a lost attempt (it may be the task's doing, so it must not get more
        tries than a task that kills its worker)."""
        outcome, lost = run.outcome, run.outcome.status == RunEnd.LOST
        hand_back(
            self.broker,
            self.recorder,
            run.claimed,
            run.ctx.task_type if run.ctx else "-",
            at_head=outcome.status != RunEnd.RETRY,
            fault=outcome.error if lost else None,
            why="task handed back after a GPU fault"
            if lost
            else f"task given back ({outcome.status})",
        )

    def _abandon(self, exc: RedisError) -> bool:
        """Wait before retrying a report (False); give up (True) only when stopping past
        the grace period (the lease then gives the task to another worker)."""
        stop_at = self.state.stop_requested_at
        if stop_at is not None and time.monotonic() - stop_at > self.settings.shutdown_grace_s:
            log.error(
                "redis still down at shutdown; the task will run again elsewhere",
                extra={"worker": self.broker.name},
            )
            return True
        wait_out(self.backoff, exc, self.broker.name)
        return False
