"""Waiting for tasks without polling: one pub/sub subscription per API process.

Every script that changes a task's status or progress (claim, finish, cancel, release,
the reaper) and a worker's progress write PUBLISH the task's id on
:data:`dispatcher.contract.keys.EVENTS` (``<id> started``, ``<id> progress`` for changes
that cannot end the task). :class:`Waiters` holds this process's one subscription to
that channel and wakes the in-process watches of the id; a woken watch re-reads the
record through the store (a wait for the end only when the change may have ended the
task: not at its start or a progress step).
Any number of clients waiting on any number of tasks cost one Redis connection, and a
notification published by a script run through any replica (or a worker) reaches the
waiters of every replica.

Routes use these calls:

- :meth:`Waiters.until_final`: the record once final, or the live one at the deadline;
  :meth:`Waiters.wait_final` the same on watches the route registered itself
  (:meth:`Waiters.watch`, :meth:`Waiters.watch_all`): ``Prefer: wait``,
  ``GET /tasks/<id>?wait=N``, ``/v1/embeddings``;
- :meth:`Waiters.follow`: each status or progress change until final (the event stream).

A route waiting on several records (the chunks of a ``/v1/embeddings`` call) gathers
one wait per record: each is a watch and a read per change that may end it, nothing
more.

:func:`unless_disconnected` runs a wait but gives up the moment the HTTP client goes
away (ASGI servers do not cancel a request handler when its client disconnects), so
a client that leaves mid-wait frees its watch at once.

A watch registers before the first read of the record, so a change between that read
and the wait is never missed; every (re)subscription wakes every watch for the same
reason (the channel keeps nothing for an absent subscriber). While the subscription is
down, watches re-read every :data:`OFFLINE_POLL_S` instead. A route that registers its
watches while the subscription is up, before it creates the records (or before it
reads one), waits with :meth:`Waiters.wait_final` and skips that first read: one read
per record, the final one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from typing import Any, Literal, TypeVar

from redis.asyncio import Redis
from redis.exceptions import ConnectionError, RedisError

from dispatcher.api.store import TaskStore
from dispatcher.contract import keys
from dispatcher.contract.backoff import Backoff
from dispatcher.contract.jobs import FINAL

__all__ = ["EventKind", "Waiters", "Watch", "change_kind", "unless_disconnected"]

log = logging.getLogger("gpulane.api")

OFFLINE_POLL_S = 1.0  # re-read period of a watch while the subscription is down
ONLINE_POLL_S = 30.0  # safety re-read while it is up (a notification cannot be lost)
# A quiet subscription is PINGed this often; no PONG by the next quiet tick: it is lost.
IDLE_PING_S = 10.0

EventKind = Literal["status", "progress", "final", "keepalive"]
NOT_FINAL = frozenset({"started", "progress"})  # published changes that cannot end a task
T = TypeVar("T")
Receive = Callable[[], Awaitable[Any]]  # an ASGI receive callable


class Watch:
    """One waiter on one task id. A notification that arrives while nobody waits is
    kept (``pending``) for the next :meth:`next`, so none falls between two waits.
    ``final``: a notification since it was last cleared may have ended the task."""

    __slots__ = ("_future", "final", "live", "pending", "task_id")

    def __init__(self, task_id: str, live: bool = False) -> None:
        self.task_id = task_id
        self.pending = False
        self.final = False
        # Registered while the subscription was up: every change made after that is
        # seen (or the resubscription that follows a loss wakes it, as a possible end).
        self.live = live
        self._future: asyncio.Future[bool] | None = None

    def notify(self, final: bool = True) -> None:
        """A change; ``final`` unless it is known not to have ended the task (a
        resubscription may have missed any change, so it counts as final)."""
        self.final = self.final or final
        if self._future is not None and not self._future.done():
            self._future.set_result(True)
        else:
            self.pending = True

    async def next(self, timeout_s: float) -> bool:
        """Wait for the next notification (True) or ``timeout_s`` (False). A future and
        a timer, no task: this sits on the path from a task's end to its answer."""
        if self.pending:
            self.pending = False
            return True
        loop = asyncio.get_running_loop()
        future = self._future = loop.create_future()
        timer = loop.call_later(max(timeout_s, 0.0), _expire, future)
        try:
            notified: bool = await future
            return notified
        finally:
            timer.cancel()
            self._future = None


def _expire(future: asyncio.Future[bool]) -> None:
    if not future.done():
        future.set_result(False)


def change_kind(last: dict[str, Any] | None, record: dict[str, Any]) -> EventKind | None:
    """What changed from ``last`` to ``record`` as an event, or None for nothing shown."""
    if record["status"] in FINAL:
        return "final"
    if last is None or record["status"] != last["status"]:
        return "status"
    if record["progress"] != last["progress"]:
        return "progress"
    if (record["attempts"], record["cancel_requested"]) != (
        last["attempts"],
        last["cancel_requested"],
    ):
        return "status"
    return None


class Waiters:
    """This process's subscription to task events, and the watches it wakes."""

    def __init__(self, client: Redis, store: TaskStore) -> None:
        self.client = client
        self.store = store
        self.online = False
        self._by_id: dict[str, set[Watch]] = {}
        self._task: asyncio.Task[None] | None = None

    # -- registry ------------------------------------------------------------------
    @property
    def count(self) -> int:
        """Watches registered now (each waiting request holds one)."""
        return sum(len(watches) for watches in self._by_id.values())

    @contextlib.contextmanager
    def watch(self, task_id: str) -> Iterator[Watch]:
        """Register a watch for the block's duration; removed at once on exit."""
        with self.watch_all([task_id]) as watches:
            yield watches[0]

    @contextlib.contextmanager
    def watch_all(self, task_ids: list[str]) -> Iterator[list[Watch]]:
        """Register a watch per id for the block's duration (a request waiting on the
        records it is about to create registers before it submits them)."""
        watches = [Watch(task_id, self.online) for task_id in task_ids]
        for watch in watches:
            self._by_id.setdefault(watch.task_id, set()).add(watch)
        try:
            yield watches
        finally:
            for watch in watches:
                held = self._by_id.get(watch.task_id)
                if held is not None:
                    held.discard(watch)
                    if not held:
                        del self._by_id[watch.task_id]

    def _wake(self, message: str) -> None:
        """A published change: ``<id>``, or ``<id> <kind>`` for one that cannot end the
        task (any other kind, one a newer publisher may add, counts as a possible end)."""
        task_id, _, kind = message.partition(" ")
        for watch in self._by_id.get(task_id, ()):
            watch.notify(kind not in NOT_FINAL)

    def _wake_all(self) -> None:
        for watches in self._by_id.values():
            for watch in watches:
                watch.notify()

    def _poll_s(self) -> float:
        return ONLINE_POLL_S if self.online else OFFLINE_POLL_S

    # -- waiting -------------------------------------------------------------------
    async def until_final(
        self, task_id: str, scope: str | None, timeout_s: float
    ) -> dict[str, Any] | None:
        """The record as soon as it is final, else as it is after ``timeout_s``; None
        when absent (or another tenant's)."""
        with self.watch(task_id) as watch:
            return await self.wait_final(watch, scope, timeout_s)

    async def wait_final(
        self, watch: Watch, scope: str | None, timeout_s: float, unread: bool = True
    ) -> dict[str, Any] | None:
        """:meth:`until_final` on a watch the caller registered. ``unread=False``: the
        caller knows the record was not final after the watch was registered (it read
        it then, or created it since), so a live watch skips the first read: anything
        that changes it from there is a notification."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        read = unread or not watch.live
        while True:
            if read:
                watch.final = False  # what this read sees
                record = await self.store.get(watch.task_id, scope)
                if record is None or record["status"] in FINAL or loop.time() >= deadline:
                    return record
            woken = await watch.next(min(deadline - loop.time(), self._poll_s()))
            # A start or a progress step cannot end the task: no read for it (a
            # single-input request would read its record three times, not two),
            # unless the deadline came with it (the answer is the live record then).
            read = not woken or watch.final or loop.time() >= deadline

    async def follow(
        self, task_id: str, scope: str | None, duration_s: float, keepalive_s: float
    ) -> AsyncGenerator[tuple[EventKind, dict[str, Any] | None], None]:
        """Yield ``(kind, record)`` for the current record and each change after it,
        ending with ``("final", record)``; ``("keepalive", None)`` after ``keepalive_s``
        without one. Ends early when the task disappears or ``duration_s`` ran out."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + duration_s
        last: dict[str, Any] | None = None
        sent_at = loop.time()
        with self.watch(task_id) as watch:
            while True:
                record = await self.store.get(task_id, scope)
                if record is None:
                    return
                kind = change_kind(last, record)
                if kind is not None:
                    yield kind, record
                    last, sent_at = record, loop.time()
                    if kind == "final":
                        return
                now = loop.time()
                if now >= deadline:
                    return
                if now - sent_at >= keepalive_s:
                    yield "keepalive", None
                    sent_at = now
                quiet = sent_at + keepalive_s - now
                await watch.next(min(deadline - now, quiet, self._poll_s()))

    # -- the subscription ------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="gpulane-waiters")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.online = False  # nothing wakes a watch now: a wait must not skip its read

    async def _run(self) -> None:
        backoff = Backoff(initial_s=0.1, cap_s=5.0)
        while True:
            try:
                await self._subscribe_and_listen(backoff)
            except (RedisError, OSError) as exc:
                if self.online:
                    log.warning("task events subscription lost: %s", exc)
            except Exception:  # a bug must not end the subscription for good
                log.exception("task events subscription failed; subscribing again")
            self.online = False
            self._wake_all()  # they fall back to periodic re-reads meanwhile
            await asyncio.sleep(backoff.next())

    async def _subscribe_and_listen(self, backoff: Backoff) -> None:
        pubsub = self.client.pubsub()
        try:
            await pubsub.subscribe(keys.EVENTS)
            unanswered = False  # a PING sent at the last quiet tick, no PONG seen since
            while True:
                message = await pubsub.get_message(timeout=IDLE_PING_S)
                if message is None:
                    if unanswered:
                        # A half-open socket (its host gone without a reset, as in a
                        # failover) reads as a quiet channel for as long as TCP lasts.
                        raise ConnectionError(f"no PONG within {IDLE_PING_S:g} s")
                    await pubsub.ping()
                    unanswered = True
                elif message["type"] == "pong":
                    unanswered = False
                elif message["type"] == "message":
                    data = message["data"]
                    self._wake(data.decode() if isinstance(data, bytes) else str(data))
                elif message["type"] == "subscribe":
                    # Anything published before this moment was not seen: re-read all.
                    self.online = True
                    backoff.reset()
                    self._wake_all()
        finally:
            with contextlib.suppress(RedisError, OSError):
                await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]  # untyped before redis 8.2


async def _disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message.get("type") == "http.disconnect":
            return


async def unless_disconnected(receive: Receive, work: Awaitable[T]) -> T | None:
    """``work``'s result, or None (and ``work`` canceled, its watch gone) as soon as the
    client disconnects. Call it once the request body has been read."""
    job = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(receive))
    left = False
    try:
        await asyncio.wait({job, gone}, return_when=asyncio.FIRST_COMPLETED)
        # Decided here, not from job.cancelled() below: a canceled gather() ends with
        # a CancelledError *result*, not as canceled, and would raise it to the route.
        left = not job.done()
    finally:
        gone.cancel()
        if not job.done():  # the client left (or we were canceled): its watch goes now
            job.cancel()
            await asyncio.gather(job, return_exceptions=True)
    return None if left else job.result()  # result() raises what work raised
