"""The order claims took tasks in, read off Redis itself: claim.lua PUBLISHes a task's id
on gpulane:events when it starts the task, and nothing else publishes a queued task's
id before that (a submit does not; a finish, progress and a hand-back come after),
except a cancel of a queued task: a test logging claims must not cancel queued tasks
(the first message would be the cancel's). Redis runs scripts one at a time and delivers a subscriber's messages in the
order it published them, so the first message naming each id is its claim, in the
order of the claims: no clocks, no ties."""

from __future__ import annotations

import threading
from types import TracebackType

import redis

from dispatcher.contract import keys
from testkit import wait_for


class ClaimLog:
    """Collect, in order, the ids of tasks as claims start them (first start only).
    Start it (a context manager) before anything can be claimed."""

    def __init__(self, redis_url: str) -> None:
        self._client = redis.Redis.from_url(redis_url)
        self._pubsub = self._client.pubsub()  # type: ignore[no-untyped-call, unused-ignore]  # untyped before redis 8.2
        self._seen: set[str] = set()
        self._order: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True, name="claim-log")

    def __enter__(self) -> ClaimLog:
        self._pubsub.subscribe(keys.EVENTS)
        # Subscribed for sure (Redis confirmed) before any claim the test causes.
        confirm = wait_for(
            lambda: self._pubsub.get_message(timeout=0.1), 5, what="the subscription"
        )
        assert confirm["type"] == "subscribe", confirm
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join(5)
        self._pubsub.close()
        self._client.close()

    def _read(self) -> None:
        while not self._stop.is_set():
            message = self._pubsub.get_message(ignore_subscribe_messages=True, timeout=0.05)
            if message is None or message["type"] != "message":
                continue
            task_id = message["data"].decode().partition(" ")[0]  # '<id> started'
            with self._lock:
                if task_id not in self._seen:
                    self._seen.add(task_id)
                    self._order.append(task_id)

    def order(self) -> list[str]:
        """The ids claimed so far, in claim order."""
        with self._lock:
            return list(self._order)

    def wait(self, count: int, timeout_s: float = 20) -> list[str]:
        """The claim order once at least ``count`` tasks were claimed."""
        found: list[str] = wait_for(
            lambda: o if len(o := self.order()) >= count else None,
            timeout_s,
            what=f"{count} claims",
        )
        return found
