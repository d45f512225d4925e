"""Reporting a batch while the next one runs (``report_overlap``).

On a GPU the card waits on whatever the worker does between two forward passes: the
last batch's report (its results sent, ``finish.lua`` run), the next claim, decoding
it. The report is the largest share (a batch of 64 packed vectors is 130 KB to send;
55-62 % of a worker's CPU in a drain of them, ``bench batched``), and nothing in the
next batch needs it. So the loop claims the next batch first, alone (Redis runs one
script at a time: a claim sent beside a 130 KB report waits for it), then hands the
report to a thread of its own and runs the batch while the report is sent. That is one
round trip more per batch than when the claim rides with the report, which is why
this is for GPU workers (``auto``): on a CPU the report's work and the model's share
the same cores.

What keeps every invariant of the inline path (``docs/design.md`` §4, "Dynamic
batching", report overlap):

- One report in flight at most: the loop settles it before it sends another, so what
  a worker holds but has not reported is bounded by one batch.
- Only runs that ended for good go this way. A hand-back (shutdown, retry, GPU fault),
  an abandoned run or a worker about to recycle is reported inline, after settling:
  their order matters and they are rare.
- Settled before a claim that asks for redelivery (claim.lua gives back what the
  worker holds ``started``: an unreported batch would run twice), before the worker
  parks, and before it stops: a worker that exits has reported what it ran.
- The thread reports through the same broker on a connection of its own (the scripts
  keep one per thread) with a backoff of its own: an outage is waited out there as it
  is inline, and the loop's next settle waits with it.
- A SIGKILL with a report in flight leaves its tasks in the worker's in-flight lists:
  the lease expires and the reaper gives them back, as during an inline report.

The bookkeeping after a report (logs, metrics, counts) stays on the loop's thread: the
settle hands the outcomes back to it.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from dispatcher.contract.backoff import Backoff
from dispatcher.contract.settings import ReportOverlap, Settings
from worker.execute import RECORDED
from worker.report import Concluded, Reporter
from worker.state import WorkerState

__all__ = ["InFlight", "Settled", "overlaps"]


def overlaps(settings: Settings, state: WorkerState) -> bool:
    """Whether this worker reports in the background: ``always``, or ``auto`` on a GPU."""
    if settings.report_overlap == ReportOverlap.AUTO:
        return state.device is not None and state.device.kind == "gpu"
    return settings.report_overlap == ReportOverlap.ALWAYS


@dataclass(frozen=True)
class Settled:
    """A background report that landed: its runs, when each ended (Redis' clock; None
    when recorded elsewhere) and the items its batch ran."""

    runs: list[Concluded]
    ended: list[int | None]
    batch_items: int


class InFlight:
    """The one report a worker may have in flight, on a thread of its own."""

    def __init__(self, reporter: Reporter) -> None:
        self._reporter = reporter
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpulane-report")
        self._pending: tuple[Future[list[int | None]], list[Concluded], int] | None = None

    @classmethod
    def for_worker(cls, reporter: Reporter) -> InFlight:
        """A background reporter beside ``reporter``: its broker, its own backoff."""
        own = Reporter(
            reporter.broker, reporter.recorder, reporter.state, reporter.settings, Backoff()
        )
        return cls(own)

    @staticmethod
    def takes(runs: list[Concluded]) -> bool:
        """Whether these runs may be reported in the background: all ended for good."""
        return all(run.outcome.status in RECORDED for run in runs)

    @property
    def busy(self) -> bool:
        return self._pending is not None

    def send(self, runs: list[Concluded], batch_items: int) -> None:
        """Start reporting ``runs``; the caller settled the last report first."""
        assert self._pending is None, "one report in flight at most"
        future = self._thread.submit(self._reporter.report, runs)
        self._pending = (future, runs, batch_items)

    def settle(self) -> Settled | None:
        """Wait for the report in flight (None: there was none). An error the reporter
        did not handle (not Redis') is raised here, on the loop's thread."""
        if self._pending is None:
            return None
        future, runs, batch_items = self._pending
        self._pending = None
        return Settled(runs, future.result(), batch_items)

    def close(self) -> None:
        """Let the thread go (after a last settle)."""
        self._thread.shutdown(wait=True)
