"""Reporting outcomes: what a run ended with goes to Redis, whatever Redis is going
through. A finished task is never dropped: an outage, a full or read-only Redis or too
few replica acks are waited out (the heartbeat keeps the lease meanwhile). Only a
script error (retrying would repeat it) or a stop past the grace period gives up, and
then the lease hands the task to another worker (at-least-once).

A batch's results go in one round trip (``finish.lua`` once per item, pipelined),
not one per item: a batch of 64 would otherwise spend 64 round trips reporting, more
than its GPU time when Redis is on another host.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from redis.exceptions import OutOfMemoryError, ReadOnlyError, RedisError

from dispatcher.contract.backoff import Backoff
from dispatcher.contract.connect import ReplicaLag, refused
from dispatcher.contract.metrics import Recorder
from dispatcher.contract.settings import Settings
from worker.broker import Broker, Claimed, Report
from worker.execute import Outcome, RunningTask
from worker.handback import hand_back
from worker.state import WorkerState

__all__ = ["REFUSED_FOR_NOW", "Concluded", "Reporter", "wait_out", "why_refused"]

log = logging.getLogger("gpulane.worker")

# Redis refused a write whole (script flags) and will take it later: not a script bug.
REFUSED_FOR_NOW = (OutOfMemoryError, ReadOnlyError)
_FINAL = ("finished", "failed", "canceled")  # finish.lua records these; the rest go back


def why_refused(exc: RedisError) -> str:
    if isinstance(exc, OutOfMemoryError):
        return "redis is full (maxmemory)"
    return "redis is read-only (a replica?)"


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


def _report(run: Concluded) -> Report:
    outcome, ctx = run.outcome, run.ctx
    progress = ctx.latest_progress if ctx else None
    return Report(run.claimed, outcome.status, outcome.result_json, outcome.error, progress)


class Reporter:
    """Hands outcomes to Redis, waiting out outages with the loop's backoff."""

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

    def report(self, runs: Sequence[Concluded]) -> list[int | None]:
        """Record every run's outcome; per run, the Redis time it ended at, or None when
        not recorded here (handed back, abandoned, or recorded by someone else)."""
        ended: list[int | None] = [None] * len(runs)
        pending = [k for k, run in enumerate(runs) if run.outcome.status in _FINAL]
        finish = partial(self._finish, runs, pending, ended)
        while pending and not self._attempt(finish, pending[0], runs):
            pass
        # Last first: tasks handed back at the head of their queue keep their order.
        for k in reversed(range(len(runs))):
            run = runs[k]
            if run.outcome.status == "abandon":
                log.warning(
                    "task abandoned: its lease was lost; not reported",
                    extra={"worker": self.broker.name, "task": run.claimed.task_id},
                )
            elif run.outcome.status not in _FINAL:
                while not self._attempt(partial(self._hand_back, run), k, runs):
                    pass
        return ended

    def _finish(
        self, runs: Sequence[Concluded], pending: list[int], ended: list[int | None]
    ) -> None:
        """One round trip for the runs still ``pending``. A recorded run leaves it; one
        Redis refused for good (a script error) is given up alone; the first error to
        wait out is raised once the others are recorded. Unconfirmed by the replicas
        (``ReplicaLag``): all stay pending to be sent again, keeping when they ended
        (the second answer is ``duplicate``)."""
        lag: ReplicaLag | None = None
        try:
            replies = self.broker.finish_many([_report(runs[k]) for k in pending])
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

    def _give_up(self, run: Concluded, exc: RedisError) -> None:
        """A script error, not an outage: retrying would never end. Leave; the lease
        hands the task to another worker, within its attempt budget."""
        log.error(
            "redis refused the report: %s",
            exc,
            extra={"worker": self.broker.name, "task": run.claimed.task_id},
        )
        self.state.mark_unhealthy("redis refused a task report (a script error)")

    def _attempt(self, step: Callable[[], None], k: int, runs: Sequence[Concluded]) -> bool:
        """Run ``step`` (a report of ``runs[k]``, perhaps with others): True when done or
        given up, False to run it again (after a wait)."""
        try:
            step()
        except REFUSED_FOR_NOW as exc:
            # Refused whole (full or read-only): keep the outcome and retry.
            self.state.set("busy", f"{why_refused(exc)}; holding a task's outcome")
            return self._abandon(exc)
        except RedisError as exc:
            if refused(exc):
                self._give_up(runs[k], exc)
                return True
            return self._abandon(exc)
        self.backoff.reset()
        return True

    def _hand_back(self, run: Concluded) -> None:
        """Give the task back: at the head (shutdown), at the tail (a retry), or after a
        GPU fault as a lost attempt (it may be the task's doing, so it must not get more
        tries than a task that kills its worker)."""
        claimed, outcome = run.claimed, run.outcome
        task_type = run.ctx.task_type if run.ctx else "-"
        if outcome.status == "lost":
            why = "task handed back after a GPU fault"
            hand_back(
                self.broker,
                self.recorder,
                claimed,
                task_type,
                at_head=True,
                fault=outcome.error,
                why=why,
            )
        else:
            why = f"task given back ({outcome.status})"
            at_head = outcome.status == "release"
            hand_back(self.broker, self.recorder, claimed, task_type, at_head=at_head, why=why)

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
