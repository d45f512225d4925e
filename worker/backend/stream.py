"""A streamed answer's way into Redis: entries queued by the relay, written by one
task per run in as few ``stream.lua`` calls as the server's pace allows (whatever
queued up while a write was under way goes in the next one), on the worker's asyncio
Redis client: a write on the first token's path costs no hop to a thread."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from redis.asyncio import Redis
from redis.exceptions import RedisError

from dispatcher.contract.backoff import Backoff
from dispatcher.contract.generation import StreamEntry
from dispatcher.contract.scripts import source
from worker.broker import Broker
from worker.claims import Claimed

__all__ = ["Fenced", "StreamAppends", "StreamWriter"]

log = logging.getLogger("gpulane.worker")

MAX_ENTRIES_PER_WRITE = 256

# Writes entries [(kind, data), ...] for the run; False when fenced.
Append = Callable[[list[tuple[str, bytes]]], Awaitable[bool]]


class StreamAppends:
    """``stream.lua`` on an asyncio client, fenced by each run's attempt."""

    def __init__(self, client: Redis, broker: Broker) -> None:
        self._script = client.register_script(source("stream"))
        self._broker = broker

    async def append(self, task: Claimed, entries: list[tuple[str, bytes]]) -> bool:
        flat = [part for kind, data in entries for part in (kind, data)]
        args = [self._broker.stream_options(task), *flat]
        return bool(await self._script(keys=[], args=args))


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
        """Wait until every entry put so far is in Redis (or the run was fenced). A
        writer that broke (a bug, not an outage: those are waited out) raises its error
        here rather than leave the run waiting for good."""
        idle = asyncio.ensure_future(self._idle.wait())
        waits: set[asyncio.Future[Any]] = {idle}
        if self._task is not None:
            waits.add(self._task)
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        idle.cancel()
        if self._task is not None and self._task.done() and not self._task.cancelled():
            error = self._task.exception()
            if error is not None:
                raise error
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
                    written = await self._append(batch)
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
