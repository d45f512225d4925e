"""Coalescing concurrent script calls into pipelines.

Under load most of an API request's CPU goes to the Redis round trip itself (redis-py's
asyncio connection handling, measured at 350-640 µs per call in ``bench/``), not to
Redis. A :class:`Coalescer` keeps at most one pipeline in flight per script: calls made
while it is out wait and leave together in the next one. A lone call goes out at once,
so there is no added delay when calls do not overlap; under load N calls cost one round
trip. Each call is still its own ``EVALSHA``, atomic on its own. A round trip is
sent as hiredis packs it on a connection of the client's pool (:func:`_exchange`),
not through redis-py's Pipeline.

A coalescer made with ``wait=(replicas, timeout_ms)`` ends each pipeline with Redis
``WAIT`` on the same connection, and each caller gets ``(reply, acks)``: how many
replicas hold every write of the pipeline (``min_replica_acks``).
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import NoScriptError, ResponseError

from dispatcher.contract.scripts import NAMES, pack_all, source

__all__ = ["AsyncScripts", "Coalescer"]

_MAX_BATCH = 256  # bounds one pipeline's size (and the wait of the last call in it)


class Coalescer:
    """Runs one Lua script for many concurrent callers, a pipeline at a time."""

    def __init__(self, client: Redis, source: str, wait: tuple[int, int] | None = None) -> None:
        self.client = client
        self.source = source
        self.wait = wait
        # The script's name on the server, as SCRIPT LOAD answers it (an id, no secret).
        self.sha = hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest()
        # SCRIPT LOAD goes in the same round trip as the first calls (and as the retry
        # after NOSCRIPT): on the connection, so on the server, that runs them, even
        # when a failover put a fresh master behind the pool since the last load.
        self._loaded = False
        self._pending: list[tuple[tuple[Any, ...], asyncio.Future[Any]]] = []
        self._flusher: asyncio.Task[None] | None = None  # held: the loop keeps a weak ref

    async def call(self, *args: Any) -> Any:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending.append((args, future))
        if self._flusher is None:
            self._flusher = asyncio.get_running_loop().create_task(self._flush())
        return await future

    async def _flush(self) -> None:
        try:
            while self._pending:
                batch = self._pending[:_MAX_BATCH]
                del self._pending[:_MAX_BATCH]
                await self._send(batch)
        finally:
            self._flusher = None

    async def _send(self, batch: list[tuple[tuple[Any, ...], asyncio.Future[Any]]]) -> None:
        calls = [args for args, _ in batch]
        try:
            replies = await self._execute(calls, load=not self._loaded)
            self._loaded = True
            retry = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
            if retry:  # Redis restarted, was flushed or failed over: load it with the retry
                again = await self._execute([calls[i] for i in retry], load=True)
                for i, reply in zip(retry, again, strict=True):
                    replies[i] = reply
        except asyncio.CancelledError:  # the loop is closing: nothing else would answer them
            for _, future in batch:
                future.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - every caller of the batch gets the failure
            self._loaded = False
            replies = [exc] * len(batch)
        for (_, future), reply in zip(batch, replies, strict=True):
            if future.done():  # the caller went away (request canceled)
                continue
            if isinstance(reply, BaseException):
                future.set_exception(reply)
            else:
                future.set_result(reply)

    async def _execute(self, calls: list[tuple[Any, ...]], load: bool = False) -> list[Any]:
        """One round trip: ``SCRIPT LOAD`` first if ``load``, an ``EVALSHA`` per call,
        then ``WAIT`` if this coalescer waits for replicas; a reply (or its error) per
        call, paired with the replicas' acks when it waits."""
        commands: list[tuple[Any, ...]] = [("SCRIPT", "LOAD", self.source)] if load else []
        commands += [("EVALSHA", self.sha, 0, *args) for args in calls]
        if self.wait is not None:
            commands.append(("WAIT", *self.wait))
        replies = await _exchange(self.client, commands)
        if load:  # the sha, or a refusal each EVALSHA then answers NOSCRIPT to as well
            replies.pop(0)
        if self.wait is None:
            return replies
        acks = replies.pop()
        if isinstance(acks, BaseException):
            return [acks] * len(replies)
        return [r if isinstance(r, BaseException) else (r, int(acks)) for r in replies]


async def _exchange(client: Redis, commands: list[tuple[Any, ...]]) -> list[Any]:
    """One round trip of ``commands`` on a connection of ``client``'s pool: each reply,
    or the error Redis answered it with; a lost connection (a timeout, a cancel) raises,
    the connection dropped. The worker's ``_exchange`` (``dispatcher.contract.scripts``)
    on asyncio, for the same reasons: packed by hiredis in one C call per command, and
    none of a Pipeline's per-call bookkeeping (a lone call costs about 90 us of the
    API's CPU here against 135 through a Pipeline), and never sent again (a reply lost
    to a reset may belong to a script that ran)."""
    packed = pack_all(commands)
    pool = client.connection_pool
    # Connected (through Sentinel, to the master), a stale one reopened first.
    conn = await pool.get_connection()  # type: ignore[no-untyped-call, unused-ignore]
    try:
        await conn.send_packed_command(packed, check_health=False)
        replies: list[Any] = []
        for _ in commands:
            try:
                replies.append(await conn.read_response())
            except ResponseError as exc:  # this command's error: the others stand
                replies.append(exc)
    except BaseException:
        # Replies may still be on the socket: never use it again as it is.
        await conn.disconnect()
        raise
    finally:
        await pool.release(conn)
    return replies


@dataclass
class AsyncScripts:
    """The scripts bound to an asyncio client (the API). Concurrent calls of one script
    share round trips (:class:`Coalescer`)."""

    client: Redis
    replica_acks: int = 0  # > 0: submits also wait for this many replicas
    ack_timeout_ms: int = 1000
    _bound: dict[str, Coalescer] = field(default_factory=dict)
    _acked: Coalescer | None = None

    def __post_init__(self) -> None:
        for name in NAMES:
            self._bound[name] = Coalescer(self.client, source(name))
        if self.replica_acks > 0:
            wait = (self.replica_acks, self.ack_timeout_ms)
            self._acked = Coalescer(self.client, source("submit"), wait)

    async def run(self, name: str, opts: str, *payload: bytes | str) -> Any:
        return await self._bound[name].call(opts, *payload)

    async def run_acked(self, name: str, opts: str, *payload: bytes | str) -> tuple[Any, int]:
        """Run ``submit`` and WAIT for the replicas: (reply, replicas that hold it)."""
        assert name == "submit" and self._acked is not None, name
        reply, acks = await self._acked.call(opts, *payload)
        return reply, int(acks)
