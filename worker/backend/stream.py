"""A streamed answer's way into Redis: entries queued by the relay, written by one
task per run in as few ``stream.lua`` calls as the server's pace allows (whatever
queued up while a write was under way goes in the next one)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import orjson
from redis.exceptions import RedisError

from dispatcher.contract.backoff import Backoff
from dispatcher.contract.generation import StreamEntry

__all__ = ["Fenced", "StreamWriter"]

log = logging.getLogger("gpulane.worker")

MAX_ENTRIES_PER_WRITE = 256

# Writes entries [(kind, data), ...] for the run; False when fenced.
Append = Callable[[list[tuple[str, bytes]]], bool]


class Fenced(Exception):
    """The run is no longer the task's current attempt: it must stop writing."""


class StreamWriter:
    def __init__(self, append: Append, task_id: str, length: Callable[[], int]) -> None:
        self._append = append
        self._length = length
        self._task_id = task_id
        self._queue: list[tuple[str, bytes]] = []
        self._more = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._fenced = False
        self._task: asyncio.Task[None] | None = None

    async def written_before(self) -> bool:
        """Whether the stream already holds entries (an earlier attempt's)."""
        return await asyncio.to_thread(self._length) > 0

    async def put(self, kind: StreamEntry, data: dict[str, Any]) -> None:
        await self.put_raw(kind, orjson.dumps(data))

    async def put_raw(self, kind: StreamEntry, data: bytes) -> None:
        """Queue an entry whose JSON is already written (a chunk as the server sent it)."""
        if self._fenced:
            raise Fenced()
        self._queue.append((kind.value, data))
        self._idle.clear()
        self._more.set()
        if self._task is None:
            self._task = asyncio.create_task(self._drain())

    async def flush(self) -> None:
        """Wait until every entry put so far is in Redis (or the run was fenced)."""
        await self._idle.wait()
        if self._fenced:
            raise Fenced()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _drain(self) -> None:
        backoff = Backoff(cap_s=2.0)
        while True:
            await self._more.wait()
            self._more.clear()
            while self._queue and not self._fenced:
                batch = self._queue[:MAX_ENTRIES_PER_WRITE]
                try:
                    written = await asyncio.to_thread(self._append, batch)
                except RedisError as exc:  # an outage: the same entries again, later
                    if backoff.failures == 0:
                        log.warning(
                            "stream write failed, retrying: %s", exc, extra={"task": self._task_id}
                        )
                    await asyncio.sleep(backoff.next())
                    continue
                backoff.reset()
                del self._queue[: len(batch)]
                if not written:
                    self._fenced = True
                    self._queue.clear()
            if not self._queue:
                self._idle.set()
